"""trace.json, the run as a Chrome trace: one track per slot, one event per request's prefill
and one per its decodes, with the times of passes.csv."""

from __future__ import annotations

import csv
import json

import numpy as np

from jaxbatch.cli import execute
from jaxbatch.config import WorkloadConfig
from tests.conftest import make_config


def test_one_event_per_request_phase_at_the_times_of_passes_csv(tmp_path):
    cfg = make_config("chunked", num_slots=3, backend="simulator", clock="passes")
    cfg.policy.token_budget = 24  # prompts of up to 40 tokens: chunked over several passes
    cfg.workload = WorkloadConfig(num_requests=7, seed=3)
    cfg.workload.prompt.dist, cfg.workload.prompt.low, cfg.workload.prompt.high = "uniform", 2, 40
    cfg.workload.output.dist, cfg.workload.output.low, cfg.workload.output.high = "uniform", 2, 9
    execute(cfg, tmp_path)
    trace = json.loads((tmp_path / "trace.json").read_text())
    passes = list(csv.DictReader((tmp_path / "passes.csv").open()))
    start = np.array([float(p["start"]) for p in passes]) * 1000.0  # a pass drawn as 1 ms
    end = start + np.array([float(p["duration"]) for p in passes]) * 1000.0
    tracks = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert [e["args"]["name"] for e in tracks] == ["slot 0", "slot 1", "slot 2"]
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    requests = list(csv.DictReader((tmp_path / "requests.csv").open()))
    assert len(events) == 2 * len(requests)  # a prefill and a decode each (no preemption)
    chunked = 0
    for e in events:
        first, last = e["args"]["first_pass"], e["args"]["last_pass"]
        assert e["ts"] == start[first] and e["ts"] + e["dur"] == end[last]
        chunked += e["cat"] == "prefill" and last > first
    for r in range(len(requests)):
        phases = sorted(e["cat"] for e in events if e["args"]["request"] == r)
        assert phases == ["decode", "prefill"]
        pre, dec = (next(e for e in events if e["args"]["request"] == r and e["cat"] == c)
                    for c in ("prefill", "decode"))  # fmt: skip
        assert pre["tid"] == dec["tid"] and pre["args"]["last_pass"] < dec["args"]["first_pass"]
    assert chunked > 0  # some prompt took several passes
