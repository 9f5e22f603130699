"""The runner's pass as a step of the device loop (`jaxbatch.device_loop`): a pure jnp function of
the loop's plan, over device state the loop carries (the KV cache and the token buffer).

Each pass runs at the host loop's shape for its plan (`Buckets.shape_fields`, one rule for numpy
and jnp): decodes as the all-slot decode, prefills as their prompts' rows (`prefill_rows`), mixed
passes flattened, one row per token. The step compiles a list of shapes, the host loop's
warm-up (a dry run's where the plans are fixed, `run.runner_step`), and a pass takes the one
equal to its own. The branches only read the cache; a pass's rows are written once after its
switch, in place: a conditional whose branches wrote the cache would make XLA copy it. Decodes
are one switch over their contexts (an idle, skipped or other pass takes its branch that
computes nothing), its B rows written after it. Every other shape of rows runs in its own path,
a while loop of at most one iteration (`inplace.run_if`) holding a switch over its contexts and
its write. A pass whose shape was not compiled computes nothing, and `check` refuses its run.

Until 2026-12-06 (fourteenth session) prefills ran flattened too, at row buckets 4x apart: the
first pass of realistic continuous (16 prompts, about 1,100 tokens) ran at 4,096 rows, with
attention over every row pair below the diagonal, for about 1 s of the run's 3.5 s (a
`jax.profiler` trace). And every (row bucket, context) pair was compiled: 18 branches, which
XLA's CPU client compiled in about 50 s and loaded from the compile cache in as long (its load
time grows faster than a program's size: in a `perf` profile, `YnnFusionThunkFromProto`
scanning the program's instructions for each YNNPACK fusion).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.backend.buckets import PassShape
from jaxbatch.backend.compilation import device_loop_options
from jaxbatch.backend.runner import (
    Runner,
    decode_rows,
    flatten,
    forward_rows,
    prefill_rows,
    store_tokens,
)
from jaxbatch.inplace import run_if
from jaxbatch.sched.state import DECODE, MIXED, Plan

_NONE = jnp.iinfo(jnp.int32).max  # what a step that runs no pass returns: no token, no row


class RunnerStep:
    """The device loop's backend for a Runner, compiled for `shapes` (the host loop's shapes)."""

    def __init__(self, runner: Runner, shapes: list[PassShape]):
        self.runner, self.buckets = runner, runner.buckets
        self.shapes = sorted(set(shapes), key=_vector)
        # What the step's program is made of besides its inputs' types (`run_device` keeps the
        # program for the next run of an equal key): the weights, the prompts, the cache and
        # the token buffer are inputs, not constants.
        self.program_key = (RunnerStep, runner.spec, runner.sampling, self.buckets,
                            tuple(self.shapes))  # fmt: skip
        self.num_branches = len(self.shapes)  # warm-up runs each once
        self.compile_options = device_loop_options()  # its program's XLA options
        # Shapes of the same rows (kind, rows, tokens per row, query tiles) share a path: a
        # switch over their contexts. The decodes' path comes first (kind 0).
        self.paths = sorted({_path(s) for s in self.shapes})

    def vector(self, plan: Plan, xp=np):
        """A plan's shape (`Buckets.shape_fields`) as `_vector` writes a PassShape."""
        rows, tokens, context, any_plan = self.buckets.shape_fields(plan, xp)
        decode, mixed = plan.kind == DECODE, plan.kind == MIXED
        tiles = xp.where(mixed, self.buckets.tiles(rows, any_plan, xp), 0)
        # a decode below every slot runs as a prefill of one token a slot (`PassShape.compact`)
        kind = xp.where(decode & (rows == self.buckets.num_slots), 0, xp.where(mixed, 1, 2))
        return xp.stack([xp.asarray(x, xp.int32) for x in (kind, rows, tokens, context, tiles)])

    def needed(self, record) -> set[PassShape]:
        """The shapes of a Record's passes (the host loop's rule, `Buckets.shape_of`): the
        passes' shape fields (`vector`) computed for all of them at once, and one PassShape
        made per distinct fields and kind (which `shape_of` also reads). A pass at a time, this
        took 23-26 ms after a 400-pass run; now 1.5-1.7 ms (2026-12-07)."""

        def plan(p=slice(None)):
            return Plan(record.req[p], record.num_tokens[p], record.start_pos[p],
                        record.kind[p], np.float32(0), np.zeros((0,), np.int32))  # fmt: skip

        if not record.num_passes:
            return set()
        keys = np.concatenate([self.vector(plan()), np.asarray(record.kind)[None]]).T
        first = np.unique(keys, axis=0, return_index=True)[1]
        return {self.buckets.shape_of(plan(int(p))) for p in first}

    def check(self, record) -> None:
        """Raises if a pass of a Record (a run of this step) needed a shape that was not
        compiled: that pass computed nothing."""
        missing = sorted(self.needed(record) - set(self.shapes), key=_vector)
        if missing:
            raise RuntimeError(f"the device loop ran passes of shapes {missing} that it did "
                               f"not compile ({len(self.shapes)} compiled)")  # fmt: skip

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
        """One pass of `plan` (nothing if `skip`; compiled shape `warm_branch` instead if >= 0):
        returns the new carry, each slot's drawn token [B], the duration (one pass: the loop's
        clock counts passes) and the shape run (rows, tokens per row, context)."""
        weights, prompt_len, request_ids = consts
        r, b = self.runner, self.runner.num_slots
        common = dict(spec=r.spec, sampling=r.sampling, num_slots=b, with_logits=False,
                      write=False)  # fmt: skip
        table = jnp.array([_vector(s) for s in self.shapes], jnp.int32)
        hit = (table == self.vector(plan, jnp)).all(axis=1)
        warm = warm_branch >= 0
        shape = jnp.where(warm, warm_branch, jnp.argmax(hit))
        found = warm | (hit.any() & ~skip)
        keys = [_path(s) for s in self.shapes]
        path = jnp.array([self.paths.index(k) for k in keys])[shape]
        at = jnp.array([self._members(k).index(s) for k, s in zip(keys, self.shapes)])[shape]

        def branch(s: PassShape):
            if s.all_slots:
                rows = lambda: decode_rows(plan, s)  # noqa: E731
            elif s.flat:
                rows = lambda: flatten(plan, s.rows, b)  # noqa: E731
            else:
                rows = lambda: prefill_rows(plan, s.rows, b, jnp)  # noqa: E731

            def run(cache, buf):
                out = forward_rows(weights, cache, buf, prompt_len, request_ids, *rows(),
                                   shape=s, **common)[1]  # fmt: skip
                # The write needs only where rows go, not how attention tiled them.
                index = out.index.replace(slots=out.index.row_slots, tiles=0, tile=0, num_slots=0)
                return out.replace(index=index)

            return run

        def written(out, cache, buf):  # the pass's K/V and tokens stored, after its switch
            return cache.write(out.ks, out.vs, out.index), store_tokens(buf, out), out.tokens

        def run_path(k: int):  # the shapes of path k: a switch over their contexts, then a write
            def run(state):
                cache, buf, _ = state
                branches = [branch(s) for s in self._members(self.paths[k])]
                return written(jax.lax.switch(at, branches, cache, buf), cache, buf)

            return run

        def others(state):
            for k, key in enumerate(self.paths):
                if key[0] != 0:
                    state = run_if(path == k, run_path(k), state)
            return state

        # Decodes are one switch over their contexts, or a branch that computes nothing for any
        # other pass, their B rows written after it; any other pass takes its path.
        cache, buf = carry
        decodes = [branch(s) for s in self.shapes if s.all_slots]
        none = jax.tree.map(
            lambda x: jnp.full(x.shape, _NONE if x.dtype == jnp.int32 else 0, x.dtype),
            jax.eval_shape(branch(self.buckets.decode(1)), cache, buf),
        )
        decoding = found & (table[shape, 0] == 0)
        out = jax.lax.switch(jnp.where(decoding, at, len(decodes)),
                             [*decodes, lambda cache, buf: none], cache, buf)  # fmt: skip
        cache, buf, tokens = run_if(found & ~decoding, others, written(out, cache, buf))
        ran = table[shape, 1], table[shape, 2], table[shape, 3]
        return (cache, buf), tokens, jnp.float32(1.0), ran

    def _members(self, key: tuple) -> list[PassShape]:
        """The shapes of one path (`self.paths`), in order of context."""
        return [s for s in self.shapes if _path(s) == key]

    def outputs(self, num_generated: np.ndarray) -> list[np.ndarray]:
        return self.runner.outputs(num_generated)


def _vector(s: PassShape) -> tuple[int, int, int, int, int]:
    """A shape as (kind: 0 decode, 1 flat, 2 prefill; rows, tokens, context, query tiles)."""
    kind = 0 if s.all_slots else (1 if s.flat else 2)
    return kind, s.rows, s.tokens, s.context, s.tiles


def _path(s: PassShape) -> tuple[int, int, int, int]:
    """The path a shape runs in (`RunnerStep.paths`): its kind, rows, tokens and query tiles."""
    kind, rows, tokens, _, tiles = _vector(s)
    return kind, rows, tokens, tiles
