"""Whole runs through execute(): output files, compile counts, rejection, metric consistency."""

from __future__ import annotations

import csv
import json

import numpy as np

from jaxbatch.cli import execute
from jaxbatch.config import LengthConfig, WorkloadConfig
from tests.conftest import make_config


def _config(policy, **workload):
    cfg = make_config(policy, num_slots=4, warmup=True)
    cfg.workload = WorkloadConfig(
        num_requests=10, prompt=LengthConfig(dist="uniform", low=4, high=60),
        output=LengthConfig(dist="uniform", low=1, high=40), **workload,
    )  # fmt: skip
    cfg.output.tokens = True
    cfg.output.plots = True
    return cfg


def test_steady_state_run_compiles_nothing_after_warmup(tmp_path):
    m = execute(_config("continuous", arrival="poisson", rate=200.0), tmp_path)
    assert m["num_compiles"] > 0
    assert m["compiles_after_warmup"] == 0
    assert not m["warmup_planned"]  # arrivals: every shape the workload can use


def test_output_files_agree_with_each_other(tmp_path):
    cfg = _config("static")
    m = execute(cfg, tmp_path)
    for name in ("metrics.json", "requests.csv", "passes.csv", "timeline.png", "tokens.jsonl"):
        assert (tmp_path / name).stat().st_size > 0
    assert json.loads((tmp_path / "metrics.json").read_text()) == m
    rows = list(csv.DictReader((tmp_path / "requests.csv").open()))
    passes = list(csv.DictReader((tmp_path / "passes.csv").open()))
    # Offline, no EOS: warm-up prepared the shapes of a dry run, which are the run's.
    shapes = {(p["rows"], p["row_tokens"], p["context"]) for p in passes}
    assert m["warmup_planned"] and m["warmup_shapes"] == len(shapes)
    assert m["compiles_after_warmup"] == 0
    tokens = [json.loads(line) for line in (tmp_path / "tokens.jsonl").open()]
    assert [int(r["id"]) for r in rows] == list(range(10))
    assert all(r["status"] == "finished" for r in rows)
    assert m["num_finished"] == 10 and m["num_passes"] == len(passes)
    out_len = [int(r["output_len"]) for r in rows]
    assert out_len == [len(t["tokens"]) for t in tokens]
    assert sum(out_len) == m["output_tokens"]
    # Static batches of 4 from 10 offline requests: 3 prefill passes.
    assert sum(p["kind"] == "prefill" for p in passes) == 3
    last_end = float(passes[-1]["start"]) + float(passes[-1]["duration"])
    assert abs(m["duration_s"] - last_end) < 1e-8
    assert abs(m["output_throughput_tok_s"] - sum(out_len) / m["duration_s"]) < 1e-6
    # Default memory: one max_len (256) reservation per held request.
    held = np.array([int(p["kv_granted"]) for p in passes]) // 256
    assert held.max() == 4 and all(
        int(p["kv_unused"]) == int(p["kv_granted"]) - int(p["kv_live"]) for p in passes
    )
    ttft = np.array([float(r["ttft_s"]) for r in rows])
    assert abs(m["ttft_s"]["max"] - ttft.max()) < 1e-5


def test_overlong_request_is_rejected_and_the_rest_run(tmp_path):
    cfg = _config("continuous")
    cfg.workload.output = LengthConfig(dist="uniform", low=1, high=250)  # some over max_len 256
    m = execute(cfg, tmp_path)
    rows = list(csv.DictReader((tmp_path / "requests.csv").open()))
    rejected = [r for r in rows if r["status"] == "rejected"]
    assert m["num_rejected"] == len(rejected) > 0
    assert m["num_finished"] + m["num_rejected"] == 10
    for r in rows:
        if r["status"] == "rejected":
            assert "max_len 256" in r["reason"] and r["output_len"] == "0"
        else:
            assert r["status"] == "finished" and r["reason"] == ""
