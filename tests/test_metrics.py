"""Metric definitions on a hand-built record, checked against values worked out by hand."""

from __future__ import annotations

import numpy as np

from jaxbatch.report.metrics import request_times, stats, summarize
from jaxbatch.report.recorder import Record
from jaxbatch.sched.state import DECODE, FINISHED, PREFILL


def _record():
    # Two slots. Pass 0 prefills request 0 (prompt 3); pass 1 decodes 0 and prefills nothing;
    # pass 2 prefills request 1 (prompt 2) while 0 is held; pass 3 decodes both.
    req = np.array([[0, -1], [0, -1], [-1, 1], [0, 1]])
    num_tokens = np.array([[3, 0], [1, 0], [0, 2], [1, 1]])
    emits = num_tokens > 0
    return Record(
        start=np.array([0.0, 1.0, 3.0, 4.0]),
        duration=np.array([1.0, 2.0, 1.0, 2.0]),
        kind=np.array([PREFILL, DECODE, PREFILL, DECODE]),
        req=req,
        num_tokens=num_tokens,
        start_pos=np.zeros_like(req),
        holder=np.array([[0, -1], [0, -1], [0, 1], [0, 1]]),
        emits=emits,
        rows=np.array([1, 2, 1, 2]),  # computed tokens 4, 2, 4, 2
        row_tokens=np.array([4, 1, 4, 1]),
        context=np.array([0, 16, 0, 16]),
        kv_tokens=np.array([3, 4, 6, 8]),
        kv_reserved=np.array([10, 10, 20, 20]),
    )


def test_request_times_by_hand():
    t = request_times(_record(), 2)
    # Request 0 emits at the ends of passes 0, 1, 3: t = 1, 3, 6. Request 1 at 4, 6.
    np.testing.assert_array_equal(t.output_len, [3, 2])
    np.testing.assert_array_equal(t.first, [1.0, 4.0])
    np.testing.assert_array_equal(t.last, [6.0, 6.0])
    np.testing.assert_array_equal(sorted(t.itl), [2.0, 2.0, 3.0])
    arrival = np.array([0.0, 2.5])
    np.testing.assert_array_equal(t.ttft(arrival), [1.0, 1.5])
    np.testing.assert_array_equal(t.e2e(arrival), [6.0, 3.5])
    np.testing.assert_array_equal(t.tpot(), [2.5, 2.0])


def test_summary_by_hand():
    m = summarize(_record(), np.array([FINISHED, FINISHED]), np.array([0.0, 2.5]),
                  np.array([3, 2]), 6.0, 2 * 10)  # fmt: skip
    assert m["output_tokens"] == 5
    assert m["output_throughput_tok_s"] == 5 / 6
    assert m["total_throughput_tok_s"] == 10 / 6
    assert m["slot_utilization"] == 5 / 8
    assert m["padding_waste"] == 1 - 8 / 12
    assert m["kv_peak_utilization"] == 20 / 20
    assert m["kv_mean_utilization"] == 15 / 20
    assert m["kv_peak_live"] == 8 / 20
    assert m["kv_mean_waste"] == np.mean([1 - 3 / 10, 1 - 4 / 10, 1 - 6 / 20, 1 - 8 / 20])
    assert m["ttft_s"]["mean"] == 1.25 and m["ttft_s"]["max"] == 1.5
    assert m["tpot_s"]["p50"] == 2.25


def test_stats_of_nothing_is_null():
    assert stats(np.array([])) == {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}
