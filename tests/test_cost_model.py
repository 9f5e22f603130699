"""The cost model: work counted by hand, prices against the roofline, the presets, priced runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from jaxbatch.backend.cost_model import (
    Hardware,
    kv_budget_tokens,
    pass_work,
    price,
    weight_bytes,
)
from jaxbatch.calibrate import _terms, fit, predict, shapes
from jaxbatch.cli import execute
from jaxbatch.config import ConfigError, HardwareConfig, ModelConfig, validate
from jaxbatch.model.spec import ModelSpec
from jaxbatch.run import hardware, memory_spec, simulate
from tests.conftest import make_config, make_workload

CONFIGS = Path(__file__).parents[1] / "configs"
SMALL = ModelSpec(vocab_size=10, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, d_mlp=12)


def _preset(group: str, name: str, cls):
    return cls(**OmegaConf.to_container(OmegaConf.load(CONFIGS / group / f"{name}.yaml")))


def _with(model: str, hw: str, tp: int = 1):
    cfg = make_config(backend="simulator", clock="priced")
    cfg.model = _preset("model", model, ModelConfig)
    cfg.hardware = dataclasses.replace(_preset("hardware", hw, HardwareConfig), tensor_parallel=tp)
    return cfg


def test_work_of_a_pass_by_hand():
    # Slot 0 decodes one token after 3 cached; slot 1 prefills 4 tokens. Head dim 4; float32.
    work = pass_work(SMALL, np.array([1, 4]), np.array([3, 0]), np.array([True, True]))
    got = {k: (np.asarray(f).tolist(), np.asarray(b).tolist()) for k, (f, b) in work.items()}
    assert got["qkv"] == (2 * 5 * 128, 128 * 4 + 5 * (8 + 16) * 4)  # weights 8 x 4 x (2 + 2)
    assert got["out"] == (2 * 5 * 64, 64 * 4 + 5 * (8 + 8) * 4)
    assert got["mlp"] == (2 * 5 * 288, 288 * 4 + 5 * (16 + 36) * 4)
    # Attention: 3 + 1 (query, key) pairs, then 0 + 10; K/V of 4 positions each, Q and O rows.
    assert got["attention"] == ([4 * 8 * 4, 4 * 8 * 10], [128 + 64, 128 + 256])
    assert got["lm_head"] == (2 * 2 * 80, 80 * 4 + 2 * 18 * 4)
    assert got["own_keys"] == (0, 0)  # not a padded flat pass
    # A padded flat (mixed) pass of 8 rows: its own keys in one block of 8 x 8 row pairs,
    # attention per request only over what each had cached (3 and 0 pairs).
    flat = pass_work(SMALL, np.array([1, 4]), np.array([3, 0]), np.array([True, True]),
                     computed=8, flat=True)  # fmt: skip
    assert np.asarray(flat["own_keys"][0]).tolist() == 4 * 8 * 64
    # 256 rows: 4 blocks of 64 rows over 64, 128, 192 and 256 rows.
    wide = pass_work(SMALL, np.array([1, 4]), np.array([3, 0]), np.array([True, True]),
                     computed=256, flat=True)  # fmt: skip
    assert np.asarray(wide["own_keys"][0]).tolist() == 4 * 8 * 64 * (64 + 128 + 192 + 256)
    assert np.asarray(flat["attention"][0]).tolist() == [4 * 8 * 3, 0]
    assert np.asarray(flat["qkv"][0]).tolist() == 2 * 8 * 128


def test_a_price_is_each_operation_at_its_bound_plus_the_overhead():
    hw = Hardware("toy", peak_flops=1000.0, memory_bandwidth=100.0, memory_bytes=1e9,
                  link_bandwidth=10.0, compute_efficiency=0.5, memory_efficiency=0.5,
                  pass_overhead_s=0.25)  # fmt: skip
    n, s, fed = np.array([1, 4]), np.array([3, 0]), np.array([True, True])
    want = 0.25 + sum(
        np.maximum(np.asarray(f) / 500.0, np.asarray(b) / 50.0).sum()
        for f, b in pass_work(SMALL, n, s, fed).values()
    )
    assert float(price(SMALL, hw, n, s, fed)) == pytest.approx(want, rel=1e-6)
    # Two devices: half the work each (all of it divides), plus two all-reduces of 5 x 8 floats.
    spec2 = dataclasses.replace(SMALL, n_kv_heads=2)
    halves = sum(
        np.maximum(np.asarray(f) / 500.0, np.asarray(b) / 50.0).sum()
        for f, b in pass_work(spec2, n, s, fed, tp=2).values()
    )
    allreduce = 2 * (2 * 0.5 * 5 * 8 * 4) / 10.0
    assert float(price(spec2, hw, n, s, fed, tp=2)) == pytest.approx(0.25 + halves + allreduce)
    # Attention at a quarter of the matmuls' rates: its time, and only its, four times over.
    slow = dataclasses.replace(hw, attention_efficiency=0.25)
    f, b = pass_work(SMALL, n, s, fed)["attention"]
    attention = np.maximum(np.asarray(f) / 500.0, np.asarray(b) / 50.0).sum()
    assert float(price(SMALL, slow, n, s, fed)) == pytest.approx(want + 3 * attention, rel=1e-6)
    # Padded: the matmuls run on the 8 rows of the pass's bucket, attention on what was fed.
    padded = dataclasses.replace(hw, padded=True)
    eight = 0.25 + sum(
        np.maximum(np.asarray(f) / 500.0, np.asarray(b) / 50.0).sum()
        for f, b in pass_work(SMALL, n, s, fed, computed=8).values()
    )
    for x, y in zip(pass_work(SMALL, n, s, fed, computed=8)["attention"],
                    pass_work(SMALL, n, s, fed)["attention"]):  # fmt: skip
        np.testing.assert_array_equal(x, y)
    assert float(price(SMALL, padded, n, s, fed, computed=8)) == pytest.approx(eight, rel=1e-6)
    assert float(price(SMALL, hw, n, s, fed, computed=8)) == pytest.approx(want, rel=1e-6)


def test_llama2_7b_on_an_h100_against_the_roofline():
    cfg = _with("llama2_7b", "h100_sxm")
    spec, hw = cfg.model.spec(), hardware(cfg)
    assert hw.peak_flops == 989e12 and hw.memory_bandwidth == 3350e9
    # Decode at batch 1: bound by reading the weights (13.5 GB in bfloat16).
    weights = weight_bytes(spec)
    assert weights == pytest.approx(13.48e9, rel=0.01)
    t = float(price(spec, hw, np.array([1]), np.array([512]), np.array([True])))
    assert 1.0 <= t / (weights / hw.memory_bandwidth) <= 1.2
    # A 4096-token prefill: every matmul is bound by compute.
    work = pass_work(spec, np.array([4096]), np.array([0]), np.array([True]))
    for op in ("qkv", "out", "mlp"):
        flops, nbytes = (float(x) for x in work[op])
        assert flops / (hw.peak_flops * 0.7) > nbytes / (hw.memory_bandwidth * 0.9), op
    # The KV budget: 90% of 80 GB less the weights, 512 KiB a position (32 layers x 2 x 4096 x 2).
    assert spec.kv_bytes_per_token == 524288
    assert memory_spec(cfg).budget_tokens == int((72e9 - weights) // 524288)
    assert kv_budget_tokens(spec, hw, 1) == memory_spec(cfg).budget_tokens


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hardware": "b200"}, "hardware.name='b200' is not valid: use one of none, a100_40gb"),
        ({"tp": 3}, "hardware.tensor_parallel=3 is not valid: must divide model.n_kv_heads=32"),
        ({"model": "llama2_70b", "hw": "a100_40gb"},
         "hardware.tensor_parallel=1 is not valid: llama2_70b's weights (138.0 GB) and one max_len "
         "sequence of KV do not fit 1 x 40 GB of a100_40gb (less a 10% activation reserve): use "
         "at least 4 devices"),
    ],
)  # fmt: skip
def test_bad_hardware_is_refused_naming_the_field(change, message):
    cfg = _with(change.get("model", "llama2_7b"), change.get("hw", "h100_sxm"), change.get("tp", 1))
    cfg.hardware.name = change.get("hardware", cfg.hardware.name)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
        memory_spec(cfg)
    assert str(err.value).startswith(message)


def test_a_priced_run_charges_each_pass_its_price():
    cfg = _with("llama2_7b", "h100_sxm")
    cfg.engine.num_slots = 4
    w = make_workload([100, 30, 700, 5, 64], [20, 3, 8, 40, 9])
    priced = simulate(cfg, w)
    counted = simulate(
        dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, clock="passes")), w
    )
    rec = priced.record
    for field in ("kind", "req", "num_tokens", "start_pos"):  # offline: the same schedule
        np.testing.assert_array_equal(getattr(rec, field), getattr(counted.record, field))
    spec, hw = cfg.model.spec(), hardware(cfg)
    want = [float(price(spec, hw, rec.num_tokens[p], rec.start_pos[p], rec.num_tokens[p] > 0))
            for p in range(rec.num_passes)]  # fmt: skip
    np.testing.assert_allclose(rec.duration, want, rtol=1e-6)
    np.testing.assert_allclose(rec.start[1:], np.cumsum(want)[:-1], rtol=1e-6)
    assert priced.duration_s == pytest.approx(sum(want), rel=1e-6)


def test_calibration_recovers_the_efficiencies_that_made_the_times():
    spec = ModelConfig().spec()
    terms = [_terms(spec, plan, int(plan.num_tokens.sum())) for _, _, plan in shapes()]
    grid, attention_grid = np.geomspace(0.002, 1.0, 120), np.geomspace(0.02, 2.0, 120)
    # Times from a known entry, on the fit's grids.
    ce, me, ae, overhead = grid[70], grid[100], attention_grid[40], 2e-4
    times = predict(terms, 20e9, 100e9, ce, me, ae, overhead)
    got = fit(terms, times, 20e9, 100e9)
    assert got[:3] == (pytest.approx(ce), pytest.approx(me), pytest.approx(ae))
    assert got[3] == pytest.approx(overhead, rel=1e-6)
    np.testing.assert_allclose(predict(terms, 20e9, 100e9, *got), times, rtol=1e-6)


def test_metrics_name_the_hardware_a_run_was_priced_for(tmp_path):
    cfg = _with("llama3_8b", "h200", tp=2)
    cfg.workload.num_requests = 4
    m = execute(cfg, tmp_path)
    assert (m["clock"], m["hardware"], m["tensor_parallel"]) == ("priced", "h200", 2)
    assert m["num_finished"] == 4 and m["duration_s"] > 0
    spec = cfg.model.spec()
    assert m["kv_budget_tokens"] == kv_budget_tokens(spec, hardware(cfg), 2)
