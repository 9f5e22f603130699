"""The runner's pass as a step of the device loop (`jaxbatch.device_loop`): a pure jnp function of
the loop's plan, over device state the loop carries (the KV cache and the token buffer).

A decode pass runs the all-slot decode; any other pass (a mixed pass, or a prefill of whole
prompts) runs flattened, one row per token, as the runner's mixed pass: at the first of a few row
buckets that holds its tokens (each 4x the last, up to the token budget's rows for orca and
chunked, or to every slot's longest sequence), with query tiles for any plan of that many
tokens. A `lax.switch` picks the compiled branch of the pass's context bucket (the host loop's
rule, `Buckets.shape_fields`), so the loop reads no more context than the host loop. The
branches only read the cache; the rows a pass computed are written once after its switch, in
place: a conditional whose branches wrote the cache would make XLA copy it. A decode is one
switch (an idle, skipped or flat pass takes its branch that computes nothing), its B rows
written after it. A flat pass runs in its row bucket's path, a while loop of at most one
iteration (`_run_if`) holding that bucket's switch and its write: one switch over every
bucket, written after, padded every pass's K/V to the largest bucket (4,096 rows for 16 slots
of 256 positions): continuous on the realistic workload of `benchmarks/throughput.py` ran at
1,112 tok/s with it, 1,713 without (medians of 2, interleaved, 2026-12-06).

Where a dry run knows every plan of a run (`run.runner_step`), only the (row bucket, context)
pairs its passes take are compiled. The program holds the model once per branch, and XLA's CPU
client loads a big program from the compile cache in time that grows faster than its size (in a
`perf` profile of the load, a scan over the program's instructions for each YNNPACK fusion,
`YnnFusionThunkFromProto`): realistic continuous, 7 branches of 18, warmed up in 27 s at its
first run and 8-10 s repeated, against 64-71 s both ways with every branch (2026-12-06).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.backend.buckets import pow2_at_least
from jaxbatch.backend.runner import Runner, decode_rows, flatten, forward_rows, store_tokens
from jaxbatch.sched.state import DECODE, Plan

_NONE = jnp.iinfo(jnp.int32).max  # what a step that runs no pass returns: no token, no row


def _run_if(pred, fn, state):
    """fn(state) if pred, else state: a while loop of at most one iteration. XLA updates a while
    loop's carry in place, where a conditional whose branches wrote the cache would copy it (a
    64 MB array, 8.4 against 0.10 ms an iteration in a microbenchmark, 2026-12-06)."""
    return jax.lax.while_loop(lambda c: c[0], lambda c: (jnp.bool_(False), fn(c[1])),
                              (pred, state))[1]  # fmt: skip


class RunnerStep:
    """The device loop's backend for a Runner whose requests need at most `longest` positions."""

    program_key = None  # its program holds the model: compiled for each run (`run_device`)

    def __init__(self, runner: Runner, longest: int, planned=None):
        self.runner, self.buckets = runner, runner.buckets
        b, min_len = runner.num_slots, runner.buckets.min_len
        # A budgeted policy's pass holds its budget; a prefill at most every slot's sequence.
        self.rows = [runner.buckets.mixed_rows or pow2_at_least(b * longest, min_len, 1 << 30)]
        while self.rows[0] // 4 >= min_len:
            self.rows.insert(0, self.rows[0] // 4)
        self.contexts = sorted({runner.buckets.context(n) for n in range(1, longest + 1)})
        # The branches compiled, as (row bucket, context bucket) pairs (row bucket len(rows): a
        # decode): the pairs of `planned`'s passes (the Record of a dry run, where one knows
        # every plan of the run: `run.runner_step`), else every pair. Warm-up runs each once.
        every = [(k, c) for k in range(len(self.rows) + 1) for c in range(len(self.contexts))]
        self.shapes = every if planned is None else sorted(self.needed(planned))
        self.num_branches = len(self.shapes)

    def bucket(self, kind, tokens, context, xp=np):
        """The (row bucket, context bucket) of passes of `kind` feeding `tokens` tokens at
        `context` (`Buckets.shape_fields`): numpy arrays of many passes, or one traced pass.
        A decode's row bucket is len(self.rows)."""
        row = xp.searchsorted(xp.asarray(self.rows), tokens, side="left")
        row = xp.where(kind == DECODE, len(self.rows), row)
        return row, xp.searchsorted(xp.asarray(self.contexts), context, side="left")

    def needed(self, record) -> set[tuple[int, int]]:
        """The (row bucket, context bucket) pairs the passes of a Record run at."""
        rows, contexts = self.bucket(record.kind, record.num_tokens.sum(axis=1), record.context)
        return set(zip(np.asarray(rows).tolist(), np.asarray(contexts).tolist()))

    def check(self, record) -> None:
        """Raises if a pass of a Record (a run of this step) needed a branch that was not
        compiled: the run left the plans of the dry run that chose them, and that pass computed
        nothing."""
        missing = sorted(self.needed(record) - set(self.shapes))
        if missing:
            named = [(self.rows[k] if k < len(self.rows) else "decode", self.contexts[c])
                     for k, c in missing]  # fmt: skip
            raise RuntimeError(f"the device loop ran passes (rows, context) {named} that its "
                               f"dry run did not plan ({len(self.shapes)} compiled)")  # fmt: skip

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
        r, b = self.runner, self.runner.num_slots
        common = dict(spec=r.spec, sampling=r.sampling, num_slots=b, with_logits=False,
                      write=False)  # fmt: skip
        context = self.buckets.shape_fields(plan, jnp)[2]
        row_bucket, bucket = self.bucket(plan.kind, plan.num_tokens.sum(), context, jnp)
        warm = warm_branch >= 0
        shapes = jnp.array(self.shapes, jnp.int32)[jnp.maximum(warm_branch, 0)]
        row_bucket = jnp.where(warm, shapes[0], row_bucket)
        bucket = jnp.where(warm, shapes[1], bucket)
        decoding = len(self.rows)

        def compiled(k: int) -> tuple[list[int], jax.Array, jax.Array]:
            """Row bucket k's compiled contexts, whether the pass's is one, and its index."""
            ours = [c for kk, c in self.shapes if kk == k]
            hit = jnp.array([*ours, -1], jnp.int32) == bucket  # -1: never, for an empty list
            return ours, hit.any(), jnp.argmax(hit)

        def branch(k: int, context: int):  # row bucket k (decoding: decode), one context
            if k == decoding:  # no prompt tokens: the cheaper all-slot decode
                shape = self.buckets.decode(self.contexts[context])
                rows = lambda: decode_rows(plan, shape)  # noqa: E731
            else:  # prompt tokens in the pass: one row per token
                shape = self.buckets.flat(self.rows[k], self.contexts[context], any_plan=True)
                rows = lambda: flatten(plan, self.rows[k], b)  # noqa: E731

            def run(cache, buf):
                out = forward_rows(weights, cache, buf, prompt_len, request_ids, *rows(),
                               shape=shape, **common)[1]  # fmt: skip
                # The write needs only where rows go, not how attention tiled them.
                index = out.index.replace(slots=out.index.row_slots, tiles=0, tile=0, num_slots=0)
                return out.replace(index=index)

            return run

        def written(out, cache, buf):  # the pass's K/V and tokens stored, after its switch
            return cache.write(out.ks, out.vs, out.index), store_tokens(buf, out), out.tokens

        def path(k: int, ours: list[int], at):  # a pass with prompt tokens in row bucket k
            def run(state):
                cache, buf, _ = state
                branches = [branch(k, c) for c in ours]
                return written(jax.lax.switch(at, branches, cache, buf), cache, buf)

            return run

        def flat(state):
            for k in range(decoding):
                ours, found, at = compiled(k)
                if ours:
                    state = _run_if((row_bucket == k) & found, path(k, ours, at), state)
            return state

        # A decode is one switch over its compiled contexts, or a branch that computes nothing
        # for any other pass (and for one not compiled: `check`), its B rows written after it;
        # a pass with prompt tokens takes its row bucket's path.
        run, decode = warm | ~skip, row_bucket == decoding
        cache, buf = carry
        ours, found, at = compiled(decoding)
        decodes = [branch(decoding, c) for c in ours]
        none = jax.tree.map(
            lambda s: jnp.full(s.shape, _NONE if s.dtype == jnp.int32 else 0, s.dtype),
            jax.eval_shape(branch(decoding, len(self.contexts) - 1), cache, buf),
        )
        out = jax.lax.switch(jnp.where(run & decode & found, at, len(ours)),
                             [*decodes, lambda cache, buf: none], cache, buf)  # fmt: skip
        cache, buf, tokens = _run_if(run & ~decode, flat, written(out, cache, buf))
        rows = jnp.array([*self.rows, b])[row_bucket]
        ran = rows, 1, jnp.array(self.contexts)[bucket]
        return (cache, buf), tokens, jnp.float32(1.0), ran

    def outputs(self, num_generated: np.ndarray) -> list[np.ndarray]:
        return self.runner.outputs(num_generated)
