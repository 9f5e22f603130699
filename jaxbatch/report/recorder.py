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


def emitted(req, num_tokens, start_pos, prompt_len: np.ndarray) -> np.ndarray:
    """Which slots (of one pass, or [P, B] of many) produced an output token: those fed whose
    tokens reach past their prompt."""
    ends = start_pos + num_tokens
    return (num_tokens > 0) & (ends >= prompt_len[np.maximum(req, 0)])


class Recorder:
    def __init__(self, prompt_len: np.ndarray):
        self._prompt_len = np.asarray(prompt_len)
        self._rows: list[tuple] = []

    def add(self, start, duration, plan: Plan, holder, shape, kv_tokens, kv_reserved) -> int:
        """Record one pass (`shape`: the PassShape it ran at); returns how many output tokens it
        produced. Keeps copies of the plan's per-slot rows, never views: a view would keep the
        whole array it came from alive (the host loop's packed plan holds every slot's block
        table: a passes x slots x blocks grid)."""
        emits = emitted(plan.req, plan.num_tokens, plan.start_pos, self._prompt_len)
        own = lambda a: np.array(a, np.int32)  # noqa: E731
        self._rows.append(
            (start, duration, int(plan.kind), own(plan.req), own(plan.num_tokens),
             own(plan.start_pos), own(holder), emits, shape.rows, shape.tokens, shape.context,
             kv_tokens, kv_reserved)
        )  # fmt: skip
        return int(emits.sum())

    def finish(self, num_slots: int) -> Record:
        if not self._rows:
            empty = np.zeros((0, num_slots), np.int64)
            z = np.zeros(0)
            i = z.astype(np.int64)
            return Record(z, z, i, empty, empty, empty, empty, empty.astype(bool), i, i, i, i, i)
        cols = list(zip(*self._rows))
        return Record(
            start=np.array(cols[0], np.float64),
            duration=np.array(cols[1], np.float64),
            kind=np.array(cols[2]),
            req=np.stack(cols[3]),
            num_tokens=np.stack(cols[4]),
            start_pos=np.stack(cols[5]),
            holder=np.stack(cols[6]),
            emits=np.stack(cols[7]),
            rows=np.array(cols[8], np.int64),
            row_tokens=np.array(cols[9], np.int64),
            context=np.array(cols[10], np.int64),
            kv_tokens=np.array(cols[11], np.int64),
            kv_reserved=np.array(cols[12], np.int64),
        )
