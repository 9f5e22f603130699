"""Per-pass events of a run, kept as arrays: the single source of every metric and figure.

One row per pass: when it started, how long it took, its kind, what each slot fed, who held each
slot, the shape it ran at (rows, tokens per row, context read: what a cost model is fitted to) and
KV positions in use. Never compute metrics here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from jaxbatch.sched.state import Plan


@dataclass(frozen=True)
class Record:
    start: np.ndarray  # [P] float64 seconds (or passes)
    duration: np.ndarray  # [P] float64
    kind: np.ndarray  # [P] int
    req: np.ndarray  # [P, B] request fed in each slot, -1 idle
    num_tokens: np.ndarray  # [P, B]
    start_pos: np.ndarray  # [P, B]
    holder: np.ndarray  # [P, B] request holding each slot (fed or not), -1 free
    emits: np.ndarray  # [P, B] bool: the slot produced an output token this pass
    rows: np.ndarray  # [P] rows of the shape the pass ran at (buckets.PassShape)
    row_tokens: np.ndarray  # [P] tokens per row of that shape
    context: np.ndarray  # [P] cached positions each row of that shape reads (0: none)
    kv_tokens: np.ndarray  # [P] KV positions holding live tokens after the pass
    kv_reserved: np.ndarray  # [P] KV positions granted (blocks or reservations) after the pass

    @property
    def num_passes(self) -> int:
        return len(self.start)

    @property
    def computed_tokens(self) -> np.ndarray:
        """[P] tokens each pass computed, padding included."""
        return self.rows * self.row_tokens

    @property
    def num_slots(self) -> int:
        return self.req.shape[1] if self.req.ndim == 2 else 0

    def in_passes(self) -> Record:
        """The same run on the passes clock: pass p starts at p and lasts 1."""
        p = self.num_passes
        return replace(self, start=np.arange(p, dtype=np.float64), duration=np.ones(p))


def emitted(req, num_tokens, start_pos, prompt_len: np.ndarray, reached=None) -> np.ndarray:
    """Which slots of a record's passes ([P, B], in pass order) produced an output token: those
    fed whose tokens end at or past their prompt and past every position their request reached
    before (`policies.commit`: a request emits once all its known tokens are cached, and they end
    one past the furthest position it reached). A preempted request recomputes its prompt and
    outputs, perhaps in pieces (chunks, or orca's pieces of a recomputation longer than its
    budget): a piece ending within what it had reached emits nothing. `reached` ([N], -1: none),
    where given, holds each request's furthest end before these passes, and is updated."""
    req, num_tokens, start_pos = (np.asarray(x) for x in (req, num_tokens, start_pos))
    fed, end, r = num_tokens > 0, start_pos + num_tokens, np.maximum(req, 0)
    out = fed & (end >= prompt_len[r])
    if reached is not None and len(req) == 1:  # one pass (the host loop's count, every pass)
        out &= end > reached[r]
        reached[r[fed]] = np.maximum(reached[r[fed]], end[fed])  # a request once a pass
        return out
    # The furthest end binds only a request fed from position 0 again (a recomputation) or one
    # fed before these passes: each pass of another ends past its last.
    again = np.bincount(r[fed & (start_pos == 0)], minlength=len(prompt_len)) > 1
    if reached is not None:
        again |= reached >= 0
    p, b = np.nonzero(fed & again[r])  # in pass order; a request is fed in one slot a pass
    if len(p):
        who, ends = r[p, b], end[p, b].astype(np.int64)
        order = np.argsort(who, kind="stable")  # by request, each one's passes in order
        who, ends, p, b = who[order], ends[order], p[order], b[order]
        start = np.full(len(prompt_len), -1) if reached is None else reached
        # a running max within each request's passes (each request's ends lifted above every
        # earlier request's), shifted by one pass: the furthest end before each
        lift = int(max(ends.max(), start.max(initial=0))) + 2
        key = np.maximum(ends, start[who]) + who.astype(np.int64) * lift
        most = np.maximum.accumulate(key) - who.astype(np.int64) * lift
        first = np.ones(len(who), bool)
        first[1:] = who[1:] != who[:-1]
        out[p, b] &= ends > np.where(first, start[who], np.roll(most, 1))
    if reached is not None:
        np.maximum.at(reached, r[fed], end[fed])
    return out


SLOT_FIELDS = ("req", "num_tokens", "start_pos", "holder")  # [B] per pass
PASS_FIELDS = ("start", "duration", "kind", "rows", "row_tokens", "context", "kv_tokens",
               "kv_reserved")  # fmt: skip
FIELDS = SLOT_FIELDS + PASS_FIELDS


def pass_row(start, duration, plan: Plan, holder, shape, kv_tokens, kv_reserved) -> dict:
    """One pass's row of the record, for both loops: numpy values in the host loop (`Recorder`),
    jnp in the device loop, which writes it into its record arrays. `shape`: the (rows, tokens
    per row, context) the pass ran at."""
    rows, row_tokens, context = shape
    return {
        "start": start, "duration": duration, "kind": plan.kind, "req": plan.req,
        "num_tokens": plan.num_tokens, "start_pos": plan.start_pos, "holder": holder,
        "rows": rows, "row_tokens": row_tokens, "context": context, "kv_tokens": kv_tokens,
        "kv_reserved": kv_reserved,
    }  # fmt: skip


def from_columns(cols: dict, prompt_len: np.ndarray, num_slots: int) -> Record:
    """The Record of a run from its rows' columns (`pass_row`'s fields, one entry per pass; {}
    for none), for both loops; which slots emitted is derived here. Per-slot grids stay int32
    (a long simulation's record is passes x slots)."""
    p = len(cols["start"]) if cols else 0

    def col(k: str, dtype, width: tuple = ()) -> np.ndarray:
        return np.asarray(cols[k], dtype).reshape(p, *width) if p else np.zeros((0, *width), dtype)

    slots = {k: col(k, np.int32, (num_slots,)) for k in SLOT_FIELDS}
    times = {k: col(k, np.float64) for k in ("start", "duration")}
    counts = {k: col(k, np.int64) for k in PASS_FIELDS if k not in times}
    emits = emitted(slots["req"], slots["num_tokens"], slots["start_pos"], np.asarray(prompt_len))
    return Record(**times, **counts, **slots, emits=emits)


class Recorder:
    """The host loop's record: a `pass_row` per pass, as host copies."""

    def __init__(self, prompt_len: np.ndarray):
        self._prompt_len = np.asarray(prompt_len)
        self._rows: list[tuple] = []
        self._reached = np.full(len(self._prompt_len), -1)  # `emitted`'s, for the counts

    def add(self, start, duration, plan: Plan, holder, shape, kv_tokens, kv_reserved) -> int:
        """Record one pass (`shape`: the PassShape it ran at); returns how many output tokens it
        produced. Keeps copies of the plan's per-slot rows, never views: a view would keep the
        whole array it came from alive (the host loop's packed plan holds every slot's block
        table: a passes x slots x blocks grid)."""
        own = lambda a: np.array(a, np.int32)  # noqa: E731
        plan = Plan(own(plan.req), own(plan.num_tokens), own(plan.start_pos), int(plan.kind),
                    plan.wait_until, None)  # fmt: skip
        shape = (shape.rows, shape.tokens, shape.context)
        row = pass_row(start, duration, plan, own(holder), shape, kv_tokens, kv_reserved)
        self._rows.append(tuple(row[k] for k in FIELDS))  # a tuple: the smallest host row
        fields = (x[None] for x in (plan.req, plan.num_tokens, plan.start_pos))
        return int(emitted(*fields, self._prompt_len, self._reached).sum())

    def columns(self) -> dict:
        """The rows so far as one array per field ([passes] or [passes, slots]): a checkpoint's."""
        return {k: np.asarray(v) for k, v in zip(FIELDS, zip(*self._rows))} if self._rows else {}

    def resume(self, columns: dict) -> None:
        """Continue after the rows of `columns` (see `columns`)."""
        self._rows = list(zip(*(columns[k] for k in FIELDS))) if columns else []
        if columns:
            fields = (np.asarray(columns[k]) for k in ("req", "num_tokens", "start_pos"))
            emitted(*fields, self._prompt_len, self._reached)

    def finish(self, num_slots: int) -> Record:
        cols = dict(zip(FIELDS, zip(*self._rows), strict=True)) if self._rows else {}
        return from_columns(cols, self._prompt_len, num_slots)
