"""A conditional update that XLA does in place.

`run_if(pred, fn, state)` is `fn(state)` if `pred`, else `state`, written as a while loop of at
most one iteration. XLA updates a while loop's carry in place, where a conditional whose branches
write their operands copies them in and out: the runner's device-loop step skips a pass kind's
path and its cache write this way (a 64 MB cache, 8.4 against 0.10 ms an iteration in a
microbenchmark, 2026-12-06), and a vmapped sweep skips its admission's scatters on the steps where
no member admits (`sched.policies._admission`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def run_if(pred, fn, state):
    """fn(state) if pred (an unbatched bool), else state; state's arrays updated in place."""
    return jax.lax.while_loop(lambda c: c[0], lambda c: (jnp.bool_(False), fn(c[1])),
                              (pred, state))[1]  # fmt: skip
