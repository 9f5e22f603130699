"""Bucket choice for jitted passes.

Every padded size a pass may be compiled for comes from here, so a run can list (and warm up)
all the shapes it needs before its clock starts. Never compile anything in this module.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from jaxbatch.sched.state import DECODE, MIXED, Plan


def pow2_at_least(n: int, lo: int, hi: int) -> int:
    """The smallest power of two >= max(n, lo), capped at hi."""
    return min(hi, max(lo, 1 << max(0, int(n) - 1).bit_length()))


QUERY_TILE = 32  # rows of a prompt chunk that read their slot's cached context together


@dataclass(frozen=True)
class PassShape:
    """The static shape of one pass: rows, tokens per row, context positions read per row
    (0: none; every row starts at position 0)."""

    rows: int
    tokens: int
    context: int
    all_slots: bool = False  # row i is slot i (decode over every slot)
    flat: bool = False  # one row per fed token, laid out from the plan on the device (mixed)
    tiles: int = 0  # flat: query tiles of QUERY_TILE rows for the rows of prompt chunks


def chunk_tiles(num_tokens: np.ndarray) -> int:
    """Query tiles a flat pass needs: each slot's rows but its last, QUERY_TILE to a tile."""
    return int((-(-np.maximum(num_tokens - 1, 0) // QUERY_TILE)).sum())


def decode_fits(plan: Plan, shape: PassShape):
    """Whether a plan is a decode pass the all-slot decode `shape` can run: one token per slot at
    most, none past its context. Works on host (numpy) and device (jax) plans alike, so the
    engine and the pass apply one rule."""
    ends = plan.start_pos + plan.num_tokens
    return (plan.kind == DECODE) & (plan.num_tokens <= 1).all() & (ends <= shape.context).all()


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

    def length(self, n: int) -> int:
        return pow2_at_least(n, self.min_len, self.max_len)

    def context(self, n: int) -> int:
        return pow2_at_least(n, max(self.min_len, self.min_context), self.max_len)

    def count(self, n: int) -> int:
        return pow2_at_least(n, 1, self.num_slots)

    def decode(self, max_end: int) -> PassShape:
        return PassShape(self.num_slots, 1, self.context(max_end), all_slots=True)

    def prefill(self, count: int, max_tokens: int, max_end: int, max_start: int = 0) -> PassShape:
        """Prompts that all start at position 0 read no cached context."""
        context = self.context(max_end) if max_start else 0
        return PassShape(self.count(count), self.length(max_tokens), context)

    def flat(self, rows: int, context: int, any_plan: bool = False) -> PassShape:
        """A flat pass of `rows` rows and its query tiles: rows / QUERY_TILE, or with
        `any_plan` as many as any plan of that many tokens can need (num_slots more)."""
        tiles = max(1, rows // QUERY_TILE) + (self.num_slots if any_plan else 0)
        return PassShape(rows, 1, context, flat=True, tiles=tiles)

    def mixed(self, total_tokens: int, max_end: int, tiles: int) -> PassShape:
        """A flattened pass: one row per token, padded to a power of two, or beyond where its
        prompt chunks need more query tiles (many short chunks in one pass); at the token
        budget's bucket, the shape with tiles for any plan."""
        cap = self.mixed_rows or 1 << 30
        rows = pow2_at_least(total_tokens, self.min_len, cap)
        while rows < cap and self.flat(rows, 0).tiles < tiles:
            rows *= 2
        return self.flat(rows, self.context(max_end), any_plan=self.flat(rows, 0).tiles < tiles)

    def shape_of(self, plan: Plan) -> PassShape:
        """The bucketed shape of a host-side (numpy) plan."""
        active = plan.num_tokens > 0
        max_end = int((plan.start_pos + plan.num_tokens)[active].max())
        if int(plan.kind) == DECODE:
            return self.decode(max_end)
        if int(plan.kind) == MIXED:
            return self.mixed(int(plan.num_tokens.sum()), max_end, chunk_tiles(plan.num_tokens))
        max_start = int(plan.start_pos[active].max())
        return self.prefill(int(active.sum()), int(plan.num_tokens.max()), max_end, max_start)

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
        decodes = [
            self.decode(c) for c in _pow2_range(self.context(int(np.min(prompt_len)) + 1), top)
        ]
        if self.mixed_rows:
            rows = _pow2_range(self.min_len, self.mixed_rows)
            contexts = _pow2_range(self.context(1), top)
            mixed = [self.flat(r, c) for r, c in itertools.product(rows, contexts)]
            mixed += [self.flat(self.mixed_rows, c, any_plan=True) for c in contexts]
            return mixed + decodes
        lengths = {self.length(p) for p in prompt_len}
        if recompute:
            lengths |= set(_pow2_range(self.length(int(np.min(prompt_len))), self.length(longest)))
        counts = sorted({self.count(c) for c in range(1, self.num_slots + 1)})
        prefill = [PassShape(c, t, 0) for c, t in itertools.product(counts, sorted(lengths))]
        return prefill + decodes


def _pow2_range(lo: int, hi: int) -> list[int]:
    out, c = [], lo
    while c < hi:
        out.append(c)
        c *= 2
    return out + [hi]
