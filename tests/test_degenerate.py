"""Degenerate workloads and edge values: refused with the field, or run to the end with every
request's status recorded. Each case failed before it was handled."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from jaxbatch.cli import execute, summary_table
from jaxbatch.config import ConfigError, LengthConfig, MemoryConfig, WorkloadConfig, validate
from jaxbatch.workload import LENGTH_CAP, read_trace
from tests.conftest import make_config

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _rows(path):
    return list(csv.DictReader((path / "requests.csv").open()))


def test_a_run_that_rejects_every_request_writes_every_file(tmp_path):
    cfg = make_config("orca", num_slots=4)
    cfg.policy.token_budget = 8  # every 32-token prompt is over orca's budget
    cfg.workload = WorkloadConfig(num_requests=5, prompt=LengthConfig(mean=32))
    cfg.output.plots = True
    m = execute(cfg, tmp_path)
    assert (m["num_rejected"], m["num_finished"], m["num_passes"]) == (5, 0, 0)
    for name in ("metrics.json", "requests.csv", "passes.csv", "record.npz", "timeline.png",
                 "memory.png"):  # fmt: skip
        assert (tmp_path / name).stat().st_size > 0
    rows = _rows(tmp_path)
    assert [r["status"] for r in rows] == ["rejected"] * 5
    assert all(r["reason"] == "prompt_len 32 > orca's policy.token_budget 8" for r in rows)
    assert [int(r["max_new_tokens"]) for r in rows] == [64] * 5  # the budget asked for
    assert "0 / 5 of 5" in summary_table(m)


@pytest.mark.parametrize("part", ["prompt", "output"])
def test_a_length_distribution_that_can_yield_zero_tokens_is_refused(part):
    cfg = make_config()
    setattr(cfg.workload, part, LengthConfig(dist="fixed", mean=0.5))
    expect = rf"^workload\.{part}\.mean=0\.5 is not valid: must be >= 1"
    with pytest.raises(ConfigError, match=expect):
        validate(cfg)


def test_the_simulator_refuses_to_write_tokens_it_has_not_got():
    cfg = make_config(backend="simulator", clock="passes")
    cfg.output.tokens = True
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert str(err.value) == (
        "output.tokens=True is not valid: the simulator runs no model, so it has no tokens to "
        "write: use engine.backend=runner or output.tokens=false"
    )


def test_eos_id_must_be_in_the_vocabulary():
    for eos in (256, -2):
        cfg = make_config(eos_id=eos)
        with pytest.raises(ConfigError) as err:
            validate(cfg)
        assert str(err.value) == (
            f"engine.eos_id={eos} is not valid: must be -1 (the model's EOS) or a token id in "
            "0..255 (model.vocab_size)"
        )
    validate(make_config(eos_id=255))


def test_a_watermark_that_admits_no_request_is_refused_naming_it(tmp_path):
    cfg = make_config(num_slots=2)
    cfg.workload = WorkloadConfig(num_requests=3, prompt=LengthConfig(mean=40))
    # 2 x 256 positions in 16-position blocks: 32 blocks; 0.95 keeps 30 free, leaving 2 (32
    # positions) for a 40-token prompt that needs 3 blocks.
    cfg.memory = MemoryConfig(layout="paged", watermark=0.95)
    with pytest.raises(ConfigError) as err:
        execute(cfg, tmp_path)
    assert str(err.value) == (
        "memory.watermark=0.95 is not valid: it keeps 30 of 32 blocks free, so admission may "
        "grant 32 KV positions, but the smallest prompt needs 48: use at most 0.9062"
    )
    cfg.memory.watermark = 0.9062  # the bound it names runs
    assert execute(cfg, tmp_path)["num_finished"] == 3


def test_a_prompt_over_the_watermark_is_rejected_and_the_rest_run(tmp_path):
    cfg = make_config(num_slots=2)
    cfg.workload = WorkloadConfig(
        num_requests=6, prompt=LengthConfig(dist="uniform", low=4, high=120), output=LengthConfig()
    )
    cfg.memory = MemoryConfig(layout="paged", watermark=0.9)  # keeps 28 of 32: 64 positions
    m = execute(cfg, tmp_path)
    rows = _rows(tmp_path)
    for r in rows:
        if int(r["prompt_len"]) > 64:
            assert r["status"] == "rejected"
            assert r["reason"].startswith(f"its prompt needs {-(-int(r['prompt_len']) // 16) * 16}")
        else:
            assert r["status"] == "finished"
    assert m["num_rejected"] == sum(int(r["prompt_len"]) > 64 for r in rows) > 0


def test_budget_message_quotes_the_budget_as_given(tmp_path):
    cfg = make_config()
    cfg.memory = MemoryConfig(budget_mib=0.0001)
    with pytest.raises(ConfigError, match=r"^memory\.budget_mib=0\.0001 is not valid"):
        execute(cfg, tmp_path)


def test_trace_counts_beyond_any_model_are_rejected_requests(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text(
        HEADER + "2023-11-16 18:17:03.0,12,5\n2023-11-16 18:17:03.5,12345678901234567890,4\n"
        "2023-11-16 18:17:04.0,7,9000000000000000000\n2023-11-16 18:17:04.5,20,3\n"
    )
    arrival, prompt, output = read_trace(trace)
    assert prompt.dtype == output.dtype == np.int64
    assert prompt.tolist() == [12, LENGTH_CAP, 7, 20] and output.tolist() == [5, 4, LENGTH_CAP, 3]
    cfg = make_config()
    cfg.workload = WorkloadConfig(kind="trace", path=str(trace))
    m = execute(cfg, tmp_path / "run")
    rows = _rows(tmp_path / "run")
    assert [r["status"] for r in rows] == ["finished", "rejected", "rejected", "finished"]
    assert rows[1]["reason"] == f"prompt_len >= {LENGTH_CAP} + max_new_tokens 4 > model max_len 256"
    assert rows[2]["reason"] == f"prompt_len 7 + max_new_tokens >= {LENGTH_CAP} > model max_len 256"
    assert m["output_tokens"] == 5 + 3


def test_the_console_summary_names_the_clock_units(tmp_path):
    cfg = make_config(clock="passes")
    cfg.workload = WorkloadConfig(num_requests=4, prompt=LengthConfig(mean=8))
    m = execute(cfg, tmp_path / "passes")
    text = summary_table(m)
    assert f"duration                      {m['num_passes']} passes (passes clock" in text
    rate = m["output_tokens"] / m["num_passes"]
    assert f"output throughput             {rate:.3f} tok/pass" in text
    ttft = m["ttft_s"]
    assert f"{ttft['p50']:.1f} / {ttft['p99']:.1f} passes" in text and " ms" not in text
    measured = execute(make_config(), tmp_path / "measured")
    text = summary_table(measured)
    assert f"{measured['duration_s']:.3f} s (measured clock" in text and "tok/s" in text
    assert json.loads((tmp_path / "measured" / "metrics.json").read_text())["clock"] == "measured"
