"""The runner's pass as a step of the device loop (`jaxbatch.device_loop`): a pure jnp function of
the loop's plan, over device state the loop carries (the KV cache and the token buffer).

A decode pass runs the all-slot decode; any other pass (a mixed pass, or a prefill of whole
prompts) runs flattened, one row per token, as the runner's mixed pass: at the first of a few row
buckets that holds its tokens (each 4x the last, up to the token budget's rows for orca and
chunked, or to every slot's longest sequence), with query tiles for any plan of that many
tokens. `lax.switch` picks the compiled branch of the pass's rows and context bucket (the host
loop's rule, `Buckets.shape_fields`), so the loop reads no more context than the host loop. The
branches only read the cache; the step writes it once after the switch, in place (a branch that
wrote it would make XLA copy the cache). An idle (or skipped) iteration takes a branch that
computes nothing and writes nothing.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.backend.buckets import pow2_at_least
from jaxbatch.backend.runner import PassOut, Runner, _forward, decode_rows, flatten, store_tokens
from jaxbatch.sched.state import DECODE, Plan


def _pad_value(dtype):
    return jnp.iinfo(jnp.int32).max if dtype == jnp.int32 else 0


def _pad_rows(x, width: int):
    """Pad a per-row array to `width` rows: padding rows are invalid (False, 0) or out of range."""
    pad = [(0, width - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
    return jnp.pad(x, pad, constant_values=_pad_value(x.dtype))


class RunnerStep:
    """The device loop's backend for a Runner whose requests need at most `longest` positions."""

    program_key = None  # its program holds the model: compiled for each run (`run_device`)

    def __init__(self, runner: Runner, longest: int):
        self.runner, self.buckets = runner, runner.buckets
        b, min_len = runner.num_slots, runner.buckets.min_len
        # A budgeted policy's pass holds its budget; a prefill at most every slot's sequence.
        self.rows = [runner.buckets.mixed_rows or pow2_at_least(b * longest, min_len, 1 << 30)]
        while self.rows[0] // 4 >= min_len:
            self.rows.insert(0, self.rows[0] // 4)
        self.contexts = sorted({runner.buckets.context(n) for n in range(1, longest + 1)})
        self.width = max(*self.rows, b)  # every branch's rows, padded alike
        # Flat branches (rows x context), then decodes; warm-up runs each once.
        self.num_branches = (len(self.rows) + 1) * len(self.contexts)

    def consts(self) -> tuple:
        """Device arrays the step reads, passed to the loop as arguments, not constants."""
        r = self.runner
        return r.params, r.prompt_len, r.request_ids

    def carry(self) -> tuple:
        """Device arrays the step reads and writes: the loop carries (and donates) them."""
        return self.runner.carry()

    def keep(self, carry: tuple) -> None:
        """The loop's final carry back into the runner (outputs are read from its buffer)."""
        self.runner.keep(carry)

    def device_step(self, consts, carry, plan: Plan, skip, warm_branch):
        """One pass of `plan` (nothing if `skip`; branch `warm_branch` instead if >= 0): returns
        the new carry, each slot's drawn token [B], the duration (one pass: the loop's clock
        counts passes) and the shape run (rows, tokens per row, context)."""
        weights, prompt_len, request_ids = consts
        cache, buf = carry
        r, b = self.runner, self.runner.num_slots
        common = dict(spec=r.spec, sampling=r.sampling, num_slots=b, with_logits=False,
                      write=False)  # fmt: skip
        args = (weights, cache, buf, prompt_len, request_ids)

        def padded(out: PassOut) -> PassOut:  # each slot's token is [b] in every branch
            # The write after the switch needs only where rows go, not how attention tiled them.
            index = out.index.replace(slots=out.index.row_slots, tiles=0, tile=0, num_slots=0)
            rows_of = out.replace(index=index, tokens=None)
            pad = partial(_pad_rows, width=self.width)
            return jax.tree.map(pad, rows_of).replace(tokens=out.tokens)

        def flat(rows, context):  # prompt tokens in the pass: one row per token
            shape = self.buckets.flat(rows, context, any_plan=True)
            return lambda: padded(_forward(*args, *flatten(plan, rows, b), shape=shape,
                                           **common)[1])  # fmt: skip

        def decode(context):  # no prompt tokens: the cheaper all-slot decode
            shape = self.buckets.decode(context)
            return lambda: padded(_forward(*args, *decode_rows(plan, shape), shape=shape,
                                           **common)[1])  # fmt: skip

        branches = [flat(r, c) for r in self.rows for c in self.contexts]
        branches += [decode(c) for c in self.contexts]
        nothing = jax.tree.map(lambda s: jnp.full(s.shape, _pad_value(s.dtype), s.dtype),
                               jax.eval_shape(branches[-1]))  # fmt: skip
        branches.append(lambda: nothing)
        context = self.buckets.shape_fields(plan, jnp)[2]
        bucket = jnp.searchsorted(jnp.array(self.contexts), context, side="left")
        row_bucket = jnp.searchsorted(jnp.array(self.rows), plan.num_tokens.sum(), side="left")
        row_bucket = jnp.where(plan.kind == DECODE, len(self.rows), row_bucket)
        branch = row_bucket * len(self.contexts) + bucket
        branch = jnp.where(
            warm_branch >= 0, warm_branch, jnp.where(skip, len(branches) - 1, branch)
        )
        out = jax.lax.switch(branch, branches)
        carry = cache.write(out.ks, out.vs, out.index), store_tokens(buf, out)
        rows = jnp.array([*self.rows, b])[row_bucket]
        ran = rows, 1, jnp.array(self.contexts)[bucket]
        return carry, out.tokens, jnp.float32(1.0), ran

    def outputs(self, num_generated: np.ndarray) -> list[np.ndarray]:
        return self.runner.outputs(num_generated)
