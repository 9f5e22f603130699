"""Updates that XLA does in place: a conditional one (`run_if`), and a vmapped scatter of the few
indices a step sets (`set_few`).

`run_if(pred, fn, state)` is `fn(state)` if `pred`, else `state`, written as a while loop of at
most one iteration. XLA updates a while loop's carry in place, where a conditional whose branches
write their operands copies them in and out: the runner's device-loop step skips a pass kind's
path and its cache write this way (a 64 MB cache, 8.4 against 0.10 ms an iteration in a
microbenchmark, 2026-12-06), and a vmapped sweep skips its admission's scatters on the steps where
no member admits (`sched.policies._admission`).
"""

from __future__ import annotations

from functools import cache

import jax
import jax.numpy as jnp


def run_if(pred, fn, state):
    """fn(state) if pred (an unbatched bool), else state; state's arrays updated in place."""
    return jax.lax.while_loop(lambda c: c[0], lambda c: (jnp.bool_(False), fn(c[1])),
                              (pred, state))[1]  # fmt: skip


def batched(axis_size: int, in_batched, args: tuple) -> tuple:
    """A `custom_vmap` rule's arguments with every unbatched leaf broadcast along a leading
    axis of `axis_size`, so the rule sees each member's own copy."""
    return jax.tree.map(
        lambda x, b: x if b else jnp.broadcast_to(x, (axis_size, *jnp.shape(x))),
        args, tuple(in_batched),
    )  # fmt: skip


def set_few(arrays: tuple, index, values: tuple) -> tuple:
    """Each of `arrays` [N] with `values`' constant at `index` [B] (indices >= 0; N or more:
    none): `arrays[i].at[index].set(values[i])`. Meant for the few indices a step sets, such as the
    requests whose slots it frees. Under vmap, XLA's CPU scatter with a batch axis runs one scalar
    update per member and index, whether the index is in range or not (4 scatters of [32 x 200]
    int32 arrays took 5.8 us at 32 indices a member and 0.7 us at 1, 2026-12-07): so where no
    member sets more than one index, each member's smallest index (the one in range, if any) is
    set alone."""
    return _setter(tuple(values))(tuple(arrays), index)


@cache
def _setter(values: tuple):
    def at(arrays, index):
        return tuple(a.at[index].set(v, mode="drop") for a, v in zip(arrays, values))

    @jax.custom_batching.custom_vmap
    def setter(arrays, index):
        return at(arrays, index)

    @setter.def_vmap
    def _(axis_size, in_batched, arrays, index):
        arrays, index = batched(axis_size, in_batched, (arrays, index))
        n = arrays[0].shape[-1]
        most = (index < n).sum(-1).max()
        one = jnp.min(index, axis=-1, keepdims=True)  # where a member sets at most one index
        out = run_if(most == 1, lambda a: jax.vmap(at)(a, one), arrays)
        out = run_if(most > 1, lambda a: jax.vmap(at)(a, index), out)
        return out, jax.tree.map(lambda _: True, out)

    return setter
