"""Bucket choice for jitted passes.

Every padded size a pass may be compiled for comes from here, so a run can list (and warm up)
all the shapes it needs before its clock starts. Never compile anything in this module.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from functools import cache

import numpy as np

from jaxbatch.model.kvcache import segment_bounds
from jaxbatch.sched.state import DECODE, MIXED, PREFILL, Plan


def pow2_at_least(n, lo: int, hi: int, xp=np):
    """The smallest power of two >= max(n, lo), capped at hi. One rule for numpy and jnp (`xp`),
    on scalars (an int with numpy) or arrays: the powers of two up to hi's, counted below n,
    then raised to lo and capped."""
    pows, buckets = _ladder(int(lo), int(hi))
    below = xp.asarray(pows) < xp.asarray(n)[..., None]  # a searchsorted (left) by counting:
    at = xp.minimum(below.sum(-1), len(pows) - 1)  # jnp's default searchsorted is a loop
    out = xp.asarray(buckets)[at]
    return int(out) if xp is np and out.ndim == 0 else out


@cache
def _ladder(lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    pows = [1 << k for k in range(max(hi - 1, 0).bit_length() + 1)]
    return np.array(pows, np.int64), np.array([min(hi, max(lo, p)) for p in pows], np.int64)


@cache
def _raised_map(raised: tuple) -> dict:
    """`Buckets.raised` as a lookup: (kind, rows, tokens, any_plan, context) -> its context."""
    return {tuple(entry[:5]): entry[5] for entry in raised}


QUERY_TILE = 32  # rows of a prompt chunk that read their slot's cached context together


@dataclass(frozen=True)
class PassShape:
    """The static shape of one pass: rows, tokens per row, context positions read per row
    (0: none; every row starts at position 0)."""

    rows: int
    tokens: int
    context: int
    all_slots: bool = False  # row i is slot i (decode over every slot)
    # A decode of the fed slots only, in slot order: rows a bucket of their count below every
    # slot, laid out from the plan on the device (as a decode over every slot is).
    compact: bool = False
    flat: bool = False  # one row per fed token, laid out from the plan on the device (mixed)
    tiles: int = 0  # flat: query tiles of QUERY_TILE rows for the rows of prompt chunks


def chunk_tiles(num_tokens: np.ndarray) -> int:
    """Query tiles a flat pass needs: each slot's rows but its last, QUERY_TILE to a tile."""
    return int((-(-np.maximum(num_tokens - 1, 0) // QUERY_TILE)).sum())


def decode_fits(plan: Plan, shape: PassShape):
    """Whether a plan is a decode pass the decode `shape` can run: one token per slot at most,
    none past its context, no more fed slots than its rows. Works on host (numpy) and device
    (jax) plans alike, so the engine and the pass apply one rule."""
    ends = plan.start_pos + plan.num_tokens
    fits = (plan.num_tokens <= 1).all() & (ends <= shape.context).all()
    return (plan.kind == DECODE) & fits & ((plan.num_tokens > 0).sum() <= shape.rows)


@dataclass(frozen=True)
class Buckets:
    num_slots: int
    max_len: int
    min_len: int = 16
    # The most rows of a mixed pass (a token budget's bucket), set for the budgeted policies,
    # whose prompt tokens all run in mixed passes; 0: the policy runs no mixed pass.
    mixed_rows: int = 0
    # The smallest context bucket (0: min_len). The slot cache's first segment: an in-place
    # read takes whole segments, so a shorter context costs the same and needs no shape of its own.
    min_context: int = 0
    # A decode of few slots runs only those slots' rows (`decode_width`). Off for
    # engine.decode_rows=all, and where a mesh splits the slots over its data axis: those rows'
    # K/V would then be gathered from other devices (`sharding.compact_decodes`).
    compact: bool = True
    # Contexts raised to the next bucket (`raise_rare`): (plan kind, rows, tokens per row,
    # any_plan, context, the context it runs at) each. Empty: every pass at its own bucket.
    raised: tuple[tuple[int, int, int, bool, int, int], ...] = ()

    def length(self, n, xp=np):
        return pow2_at_least(n, self.min_len, self.max_len, xp)

    def context(self, n, xp=np):
        return pow2_at_least(n, max(self.min_len, self.min_context), self.max_len, xp)

    def count(self, n, xp=np):
        return pow2_at_least(n, 1, self.num_slots, xp)

    def decode_width(self, active, xp=np):
        """The rows of a decode of `active` slots (numpy or jnp): the bucket of their count
        (`count`) where it is at most a quarter of the slots, else every slot. A decode of few
        requests then runs only their rows and reads only their contexts, as a serving engine
        runs a batch of its running requests (vLLM's CUDA graphs take a bucket of the batch
        size likewise): 1, 2, 4 and 8 of 16 slots at context 256 took 0.33, 0.43, 0.52 and 0.76
        of the all-slot decode's time, with the same tokens (tiny model, 4 KV heads,
        2026-12-07). Above a quarter the gain is small and a shape costs its compilation and
        warm-up (the runner-heavy tests took 21% longer with every bucket compacted)."""
        count = self.count(active, xp)
        small = self.compact & (count <= self.num_slots // 4)
        return xp.where(small, count, self.num_slots)

    def decode(self, max_end: int, active: int | None = None) -> PassShape:
        """A decode of `active` slots (default: all), the furthest ending at `max_end`, at its
        context bucket and `decode_width`: row i slot i at every slot, else the fed slots in
        order (`compact`)."""
        rows = self.num_slots if active is None else int(self.decode_width(active))
        context = int(self.lifted(DECODE, rows, 1, False, self.context(max_end)))
        if rows == self.num_slots:
            return PassShape(rows, 1, context, all_slots=True)
        return PassShape(rows, 1, context, compact=True)

    def prefill(self, count: int, max_tokens: int, max_end: int, max_start: int = 0) -> PassShape:
        """Prompts that all start at position 0 read no cached context."""
        rows, tokens = self.count(count), self.length(max_tokens)
        context = int(self.lifted(PREFILL, rows, tokens, False, self.context(max_end)))
        return PassShape(rows, tokens, context if max_start else 0)

    def flat(self, rows: int, context: int, any_plan: bool = False) -> PassShape:
        """A flat pass of `rows` rows and its query tiles: rows / QUERY_TILE, or with
        `any_plan` as many as any plan of that many tokens can need (num_slots more)."""
        context = int(self.lifted(MIXED, rows, 1, any_plan, context))
        return PassShape(rows, 1, context, flat=True, tiles=int(self.tiles(rows, any_plan)))

    def lifted(self, kind, rows, tokens, any_plan, context, xp=np):
        """The context a pass of these fields runs at: its bucket, or the one `raised` names
        for it (numpy or jnp; a host pass's scalars by one lookup, on the loop's path)."""
        if not self.raised:
            return context
        if xp is np and np.ndim(context) == 0:
            key = (int(kind), int(rows), int(tokens), bool(any_plan), int(context))
            return _raised_map(self.raised).get(key, context)
        for k, r, t, a, c, to in self.raised:
            hit = (kind == k) & (rows == r) & (tokens == t) & (any_plan == a) & (context == c)
            context = xp.where(hit, to, context)
        return context

    def raise_rare(self, counts: dict[PassShape, int], at_most: int) -> Buckets:
        """These buckets with each shape that `counts` (passes per shape, a dry run's) meets at
        most `at_most` times raised to the next context bucket of the same rows, where `counts`
        has that shape and does not raise it itself: the run then compiles, loads and first runs
        one program fewer (0.2-0.9 s of CPU each for realistic chunked's mixed passes, 2 cores,
        2026-12-07) for a few passes that read more context (one bucket up took 1.10-1.28x the
        time: mixed 512 rows 27.8 ms at context 64 against 30.6 at 128, 256 rows 14.7 against
        17.7 ms, decode 16 slots 3.59 against 4.07 ms). A shape reading no context stays."""
        raised, kept = [], set(counts)
        for shape in sorted(counts, key=lambda s: -s.context):  # a raised shape is not kept
            up = replace(shape, context=self.context(shape.context + 1))
            if 0 < shape.context < up.context and counts[shape] <= at_most and up in kept:
                raised.append((*self._fields(shape), shape.context, up.context))
                kept.discard(shape)
        return replace(self, raised=self.raised + tuple(raised))

    def runs_at(self, shape: PassShape) -> PassShape:
        """The shape a pass of `shape`'s bucket runs at (`raised`)."""
        return replace(shape, context=int(self.lifted(*self._fields(shape), shape.context)))

    def _fields(self, shape: PassShape) -> tuple[int, int, int, bool]:
        """(plan kind, rows, tokens per row, any_plan) of a shape, as `raised` keys them."""
        kind = DECODE if shape.all_slots or shape.compact else MIXED if shape.flat else PREFILL
        any_plan = shape.flat and shape.tiles > int(self.tiles(shape.rows, False))
        return kind, shape.rows, shape.tokens, any_plan

    def tile_context(self, plan: Plan, context, xp=np):
        """The cached positions a flat pass's query tiles read, where the pass skips the
        segments no prompt chunk's row sees (`pass_attention.skips_unseen`): the segments up to
        the one holding the position before the furthest chunk's first, at most `context`; none
        where every chunk starts at position 0. A slot cache reads whole segments
        (`kvcache.segment_bounds`, its first `min_context` long), a paged one all of `context`
        as one (`min_context` 0). Numpy or jnp, per pass like `shape_fields`."""
        chunk = plan.num_tokens > 1  # a slot with rows besides its last: its rows are tiled
        first = xp.max(xp.where(chunk, plan.start_pos, 0), axis=-1)
        paged = not self.min_context
        bounds = xp.asarray([0, self.max_len] if paged else
                            segment_bounds(self.max_len, self.min_context))  # fmt: skip
        end = bounds[xp.searchsorted(bounds, first)]  # the first bound at or past `first`
        return xp.where(first > 0, xp.minimum(end, context), 0)

    def tiles(self, rows, any_plan, xp=np):
        """Query tiles of a flat pass of `rows` rows (numpy or jnp): one per QUERY_TILE rows,
        and num_slots more for the shape that runs any plan of that many tokens."""
        return xp.maximum(1, rows // QUERY_TILE) + xp.where(any_plan, self.num_slots, 0)

    def shape_fields(self, plan: Plan, xp=np, mixed_rows=None):
        """A pass's bucketed shape as (rows, tokens per row, context, any_plan), by one rule for
        host (numpy) and device (jnp) plans alike: `shape_of` makes the host loop's PassShape of
        it; the device loops record it. Decode: `decode_width`, one token, its context bucket.
        Mixed: one row per token, padded to a power of two, or beyond where its prompt chunks
        need more query tiles (many short chunks in one pass); at the token budget's bucket, the
        shape with tiles for any plan (`any_plan`); its context is the bucket of its rows'
        first positions (it reads only what was cached before it). Prefill: the count and
        length buckets of its prompts; prompts that all start at position 0 read no cached
        context. `mixed_rows` (traced, as the simulator's sweeps vary the token budget) stands
        for the field. Plans with a leading axis (a record's passes: per-slot fields [P, B], kind
        [P]) give one shape per pass."""
        active = plan.num_tokens > 0
        max_end = xp.max(xp.where(active, plan.start_pos + plan.num_tokens, 0), axis=-1)
        max_start = xp.max(xp.where(active, plan.start_pos, 0), axis=-1)
        tiles = xp.sum(-(-xp.maximum(plan.num_tokens - 1, 0) // QUERY_TILE), axis=-1)
        at_least = xp.maximum(xp.sum(plan.num_tokens, axis=-1),
                              xp.where(tiles > 1, tiles * QUERY_TILE, 0))  # fmt: skip
        cap = self.mixed_rows if mixed_rows is None else mixed_rows
        cap = xp.where(cap > 0, cap, 1 << 30)  # the ladder capped at cap (>= min_len, a bucket)
        mixed_rows = xp.minimum(pow2_at_least(at_least, self.min_len, 1 << 30, xp), cap)
        decode, mixed = plan.kind == DECODE, plan.kind == MIXED
        n_active = xp.sum(active, axis=-1)
        count = self.count(n_active, xp)
        rows = xp.where(mixed, mixed_rows, xp.where(decode, self.decode_width(n_active, xp), count))
        tokens = xp.where(decode | mixed, 1, self.length(xp.max(plan.num_tokens, axis=-1), xp))
        any_plan = mixed & (xp.maximum(1, mixed_rows // QUERY_TILE) < tiles)
        context = xp.where(mixed, self.context(max_start, xp), self.context(max_end, xp))
        context = self.lifted(plan.kind, rows, tokens, any_plan, context, xp)
        context = xp.where(decode | mixed | (max_start > 0), context, 0)
        return rows, tokens, context, any_plan

    def shape_of(self, plan: Plan) -> PassShape:
        """The bucketed shape of a host-side (numpy) plan (see `shape_fields`)."""
        rows, tokens, context, any_plan = (int(x) for x in self.shape_fields(plan))
        if int(plan.kind) == DECODE:
            every = rows == self.num_slots
            return PassShape(rows, 1, context, all_slots=every, compact=not every)
        if int(plan.kind) == MIXED:
            return self.flat(rows, context, any_plan=bool(any_plan))
        return PassShape(rows, tokens, context)

    def for_workload(
        self, prompt_len: np.ndarray, max_new: np.ndarray, recompute: bool = False
    ) -> list[PassShape]:
        """Every shape a run of these requests can use (prompts start at 0): mixed passes of
        every row bucket for a budgeted policy (`mixed_rows`), else prefill passes; and decodes.
        With `recompute` (preemption), a prefill may also hold a prompt and its outputs."""
        if len(prompt_len) == 0:
            return []
        longest = int(np.max(prompt_len + max_new))
        top = self.context(longest)
        counts = sorted({self.count(c) for c in range(1, self.num_slots + 1)})
        contexts = _pow2_range(self.context(int(np.min(prompt_len)) + 1), top)
        decodes = sorted({self.decode(c, a) for c, a in itertools.product(contexts, counts)},
                         key=lambda s: (s.context, s.rows))  # fmt: skip
        if self.mixed_rows:
            rows = _pow2_range(self.min_len, self.mixed_rows)
            contexts = _pow2_range(self.context(1), top)
            mixed = [self.flat(r, c) for r, c in itertools.product(rows, contexts)]
            mixed += [self.flat(self.mixed_rows, c, any_plan=True) for c in contexts]
            return mixed + decodes
        lengths = {self.length(p) for p in prompt_len}
        if recompute:
            lengths |= set(_pow2_range(self.length(int(np.min(prompt_len))), self.length(longest)))
        prefill = [PassShape(c, t, 0) for c, t in itertools.product(counts, sorted(lengths))]
        return prefill + decodes


def _pow2_range(lo: int, hi: int) -> list[int]:
    out, c = [], lo
    while c < hi:
        out.append(c)
        c *= 2
    return out + [hi]
