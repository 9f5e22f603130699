"""Metrics of a run, as vLLM's benchmark defines them, computed from the Record alone.

TTFT = first token time - arrival; TPOT = (E2E - TTFT) / (output_len - 1) over requests with more
than one output token; ITL = gaps between consecutive output tokens; E2E = last token - arrival.
A token's time is the end of the pass that produced it. Never run or schedule anything here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxbatch.report.recorder import Record
from jaxbatch.sched.state import FINISHED

PERCENTILES = (50, 90, 99)


def stats(values: np.ndarray) -> dict[str, float | None]:
    """{mean, p50, p90, p99, max}; None for each when there are no values."""
    values = np.asarray(values, np.float64)
    if values.size == 0:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}, "max": None}
    out = {"mean": float(values.mean())}
    out.update({f"p{q}": float(np.percentile(values, q)) for q in PERCENTILES})
    out["max"] = float(values.max())
    return out


@dataclass(frozen=True)
class RequestTimes:
    """Per request [N]: output tokens, first and last token time (nan if none), and all ITL gaps."""

    output_len: np.ndarray
    first: np.ndarray
    last: np.ndarray
    itl: np.ndarray  # every gap of every request, concatenated

    def ttft(self, arrival: np.ndarray) -> np.ndarray:
        return self.first - arrival

    def e2e(self, arrival: np.ndarray) -> np.ndarray:
        return self.last - arrival

    def tpot(self) -> np.ndarray:
        """nan where a request has fewer than two output tokens."""
        with np.errstate(invalid="ignore", divide="ignore"):
            t = (self.last - self.first) / (self.output_len - 1)
        return np.where(self.output_len > 1, t, np.nan)


def request_times(record: Record, num_requests: int) -> RequestTimes:
    end = record.start + record.duration
    p, b = np.nonzero(record.emits)
    req, when = record.req[p, b], end[p]
    order = np.lexsort((when, req))
    req, when = req[order], when[order]
    output_len = np.bincount(req, minlength=num_requests)
    first = np.full(num_requests, np.nan)
    last = np.full(num_requests, np.nan)
    # Fancy assignment keeps the last write: reversed, the earliest time wins for `first`.
    first[req[::-1]] = when[::-1]
    last[req] = when
    same = req[1:] == req[:-1]
    itl = np.diff(when)[same]
    return RequestTimes(output_len=output_len, first=first, last=last, itl=itl)


def summarize(
    record: Record,
    status: np.ndarray,
    arrival: np.ndarray,
    prompt_len: np.ndarray,
    duration_s: float,
    kv_capacity_tokens: int,
) -> dict:
    """The headline metrics of metrics.json (without the run's identity fields)."""
    times = request_times(record, len(arrival))
    done = status == FINISHED
    out_tokens = int(times.output_len.sum())
    prompt_tokens = int(prompt_len[done].sum())
    slot_passes = record.num_slots * record.num_passes
    computed = int(record.computed_tokens.sum())
    useful = int(record.num_tokens.sum())
    rate = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    return {
        "num_finished": int(done.sum()),
        "num_passes": record.num_passes,
        "duration_s": float(duration_s),
        "output_tokens": out_tokens,
        "output_throughput_tok_s": rate(out_tokens),
        "total_throughput_tok_s": rate(out_tokens + prompt_tokens),
        "request_throughput_req_s": rate(int(done.sum())),
        "ttft_s": stats(times.ttft(arrival)[done]),
        "tpot_s": stats(times.tpot()[done & (times.output_len > 1)]),
        "itl_s": stats(times.itl),
        "e2e_s": stats(times.e2e(arrival)[done]),
        "slot_utilization": (record.num_tokens > 0).sum() / slot_passes if slot_passes else 0.0,
        "padding_waste": 1.0 - useful / computed if computed else 0.0,
        **kv_metrics(record, kv_capacity_tokens),
    }


def kv_metrics(record: Record, capacity: int) -> dict:
    """Peak and mean share of the budget granted, and the mean share of granted KV positions
    that hold no live token (internal fragmentation and over-reservation)."""
    granted = record.kv_reserved
    used = granted > 0
    waste = 1.0 - record.kv_tokens[used] / granted[used]
    return {
        "kv_peak_utilization": float(granted.max(initial=0) / capacity),
        "kv_mean_utilization": float(granted.mean() / capacity) if record.num_passes else 0.0,
        "kv_peak_live": float(record.kv_tokens.max(initial=0) / capacity),
        "kv_mean_waste": float(waste.mean()) if used.any() else 0.0,
    }
