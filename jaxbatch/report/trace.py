"""A run as a Chrome trace (trace.json): open it in Perfetto (ui.perfetto.dev) or chrome://tracing
for an interactive timeline, one track per slot.

Each request's time in a slot is a `prefill` event (the passes that fed its prompt, in chunks or
whole, or recomputed it after a preemption) and a `decode` event (the passes that fed it one
generated token), from the start of the phase's first pass to the end of its last, with the times
of passes.csv. Computed from the Record alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxbatch.report.recorder import Record

PASS_US = 1000.0  # on the passes clock, a pass is drawn as a millisecond


def trace_events(record: Record, prompt_len: np.ndarray, clock: str) -> list[dict]:
    """Chrome trace events: a name per slot's track, then one complete ("X") event per
    (slot, request, phase) run of passes; a phase ends when its slot feeds another request or
    the same request in the other phase."""
    scale = PASS_US if clock == "passes" else 1e6  # to microseconds
    b = record.num_slots
    events: list[dict] = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": s, "args": {"name": f"slot {s}"}}
        for s in range(b)
    ]
    fed = record.num_tokens > 0
    req = np.maximum(record.req, 0)
    prefill = fed & ((record.num_tokens > 1) | (record.start_pos < np.asarray(prompt_len)[req]))
    end = record.start + record.duration
    for s in range(b):
        ps = np.flatnonzero(fed[:, s])
        if not len(ps):
            continue
        r, ph = record.req[ps, s], prefill[ps, s]
        change = np.r_[True, (r[1:] != r[:-1]) | (ph[1:] != ph[:-1])]
        firsts = np.flatnonzero(change)
        lasts = np.r_[firsts[1:] - 1, len(ps) - 1]
        for i, j in zip(firsts, lasts):
            run = [int(r[i]), "prefill" if ph[i] else "decode", int(ps[i]), int(ps[j])]
            events.append(_event(run, s, record.start, end, scale))
    return events


def _event(run: list, slot: int, start: np.ndarray, end: np.ndarray, scale: float) -> dict:
    r, phase, first, last = run
    return {
        "name": f"req {r} {phase}", "cat": phase, "ph": "X", "pid": 0, "tid": slot,
        "ts": float(start[first]) * scale, "dur": float(end[last] - start[first]) * scale,
        "args": {"request": r, "first_pass": int(first), "last_pass": int(last)},
    }  # fmt: skip


def write_trace(path: Path, record: Record, prompt_len: np.ndarray, clock: str) -> None:
    events = trace_events(record, prompt_len, clock)
    unit = "passes (1 pass = 1 ms)" if clock == "passes" else "seconds"
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms",
                                "otherData": {"clock": clock, "unit": unit}}))  # fmt: skip
