"""The cost model: work counted by hand, prices against the roofline, the presets, priced runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from omegaconf import OmegaConf

from jaxbatch.backend.buckets import Buckets
from jaxbatch.backend.cost_model import (
    Hardware,
    Padded,
    kv_budget_tokens,
    pass_work,
    price,
    runner_shape,
    weight_bytes,
)
from jaxbatch.calibrate import _terms, fit, predict, shapes
from jaxbatch.cli import execute
from jaxbatch.config import ConfigError, HardwareConfig, ModelConfig, validate
from jaxbatch.model.spec import ModelSpec
from jaxbatch.run import build_backend, hardware, memory_spec, simulate
from jaxbatch.sched.state import DECODE, MIXED, PREFILL, Plan
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
    assert got["own_keys"] == (0, 0)  # only the runner's flat pass has them apart


def test_work_at_the_runners_padded_shapes_by_hand():
    """Padded: every operation as the runner computes it. Per (query, key) pair 4 x 2 heads x 4
    = 32 FLOPs; per cached position 2 x 4 x 4 = 32 bytes of K/V; per query 64 bytes of Q and O."""
    n, s, fed = np.array([1, 4]), np.array([3, 0]), np.array([True, True])

    def work(rows, tokens, context, tiles, kind, tile_context=None):
        read = context if tile_context is None else tile_context  # the tiles' positions
        shape = Padded(rows, tokens, context, tiles, kind, 2, read)
        w = pass_work(SMALL, n, s, fed, padded=shape)
        return {k: (float(np.sum(f)), float(np.sum(b))) for k, (f, b) in w.items()}

    # A flat pass of 8 rows, 1 query tile, context bucket 16: both slots' last rows and the
    # tile's 32 query rows read 16 positions each (3 reads); the own keys in one 8 x 8 block.
    flat = work(8, 1, 16, 1, MIXED)
    assert flat["qkv"][0] == 2 * 8 * 128
    assert flat["attention"] == (32 * (2 + 32) * 16, 32 * (3 * 16 + 8) + 64 * 8)
    assert flat["own_keys"] == (32 * 8 * 8, 0.0)
    # Its chunks all from position 0: the tile reads nothing (`Buckets.tile_context`).
    first = work(8, 1, 16, 1, MIXED, tile_context=0)
    assert first["attention"] == (32 * 2 * 16, 32 * (2 * 16 + 8) + 64 * 8)
    # 256 rows: 4 blocks of 64 rows over 64, 128, 192 and 256 rows.
    assert work(256, 1, 16, 8, MIXED)["own_keys"][0] == 32 * 64 * (64 + 128 + 192 + 256)
    # Decode over both slots at context bucket 64, whatever each slot holds.
    assert work(2, 1, 64, 0, DECODE)["attention"] == (32 * 2 * 64, 32 * (2 * 64 + 2) + 64 * 2)
    # Prefill of 2 rows x 16 tokens from position 0: each row's full 16 x 16 product.
    prefill = work(2, 16, 0, 0, PREFILL)
    assert prefill["attention"] == (32 * 2 * 16 * 16, 32 * 32 + 64 * 32)
    assert prefill["own_keys"] == (0.0, 0.0)
    # The LM head runs on a prefill's rows (4 in the bucket, 2 fed), else on every slot.
    assert work(4, 16, 0, 0, PREFILL)["lm_head"][0] == 2 * 4 * 80
    assert work(2, 1, 64, 0, DECODE)["lm_head"][0] == flat["lm_head"][0] == 2 * 2 * 80
    # After cached context (bucket 64): each row's 16 queries over its 64 positions.
    assert work(2, 16, 64, 0, PREFILL)["attention"] == (32 * 2 * 16 * 64, 32 * (128 + 32) + 64 * 32)


def test_the_runners_shape_is_the_runners_rule():
    """`runner_shape` (numpy and jnp) gives a flat pass the query tiles the runner compiles."""
    buckets = Buckets(num_slots=4, max_len=1024, min_len=16, mixed_rows=64, min_context=64)
    plans = {  # (num_tokens, start_pos, the tiles the runner compiles)
        "one chunk of 50: 2 tiles, 64 rows": ([1, 1, 50, 0], [40, 9, 100, 0], 64 // 32),
        "4 chunks of 16: 4 tiles, the any-plan shape": ([16] * 4, [0, 0, 0, 5], 64 // 32 + 4),
    }
    for label, (num, start, tiles) in plans.items():
        plan = Plan(np.arange(4, dtype=np.int32), np.array(num, np.int32),
                    np.array(start, np.int32), np.int32(MIXED), np.float32(0), None)  # fmt: skip
        shape = buckets.shape_of(plan)
        assert shape.tiles == tiles, label
        for xp in (np, jnp):
            got = [int(x) for x in runner_shape(buckets, plan, xp)[:5]]
            assert got == [shape.rows, 1, shape.context, tiles, MIXED], label


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
    # A padded entry prices the runner's shape of the pass; any other ignores it.
    padded = dataclasses.replace(hw, padded=True)
    shape = Padded(8, 1, 16, 1, MIXED, 2, 16)
    eight = 0.25 + sum(
        np.maximum(np.asarray(f) / 500.0, np.asarray(b) / 50.0).sum()
        for f, b in pass_work(SMALL, n, s, fed, padded=shape).values()
    )
    assert eight > want
    assert float(price(SMALL, padded, n, s, fed, padded=shape)) == pytest.approx(eight, rel=1e-6)
    assert float(price(SMALL, hw, n, s, fed, padded=shape)) == pytest.approx(want, rel=1e-6)
    # A prefill and a mixed pass pay their kind's overhead on top; a decode does not.
    kinded = dataclasses.replace(hw, prefill_overhead_s=0.5, mixed_overhead_s=0.75)
    for kind, extra in ((PREFILL, 0.5), (MIXED, 0.75), (DECODE, 0.0), (None, 0.0)):
        got = float(price(SMALL, kinded, n, s, fed, kind=kind))
        assert got == pytest.approx(want + extra, rel=1e-6), kind
    # Overlap 0: each operation costs its compute time plus its memory time; 0.5: the longer
    # plus half the shorter.
    for overlap in (0.0, 0.5):
        serial = dataclasses.replace(hw, overlap=overlap)
        summed = 0.25 + sum(
            ((c := np.asarray(f) / 500.0) + (m := np.asarray(b) / 50.0)
             - overlap * np.minimum(c, m)).sum()
            for f, b in pass_work(SMALL, n, s, fed).values()
        )  # fmt: skip
        assert summed > want
        assert float(price(SMALL, serial, n, s, fed)) == pytest.approx(summed, rel=1e-6)


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
        ({"overheads": (-5.0, 0.0)},
         "hardware.pass_overhead_us=-5.0 is not valid: a pass's overhead (pass_overhead_us) must "
         "be >= 0"),
        ({"overheads": (100.0, -200.0)},
         "hardware.mixed_overhead_us=-200.0 is not valid: a mixed pass's overhead "
         "(pass_overhead_us + mixed_overhead_us) must be >= 0"),
        ({"overlap": 1.5},
         "hardware.overlap=1.5 is not valid: must be in [0, 1]: the share of an operation's "
         "shorter time (compute or memory) that the longer hides"),
    ],
)  # fmt: skip
def test_bad_hardware_is_refused_naming_the_field(change, message):
    cfg = _with(change.get("model", "llama2_7b"), change.get("hw", "h100_sxm"), change.get("tp", 1))
    cfg.hardware.name = change.get("hardware", cfg.hardware.name)
    cfg.hardware.pass_overhead_us, cfg.hardware.mixed_overhead_us = change.get("overheads", (0, 0))
    cfg.hardware.overlap = change.get("overlap", 1.0)
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


def test_a_padded_entry_charges_each_pass_the_runners_shape_and_its_kinds_overhead():
    """A simulated chunked run priced on a padded entry (as `cpu_local` is): every pass costs
    its price at the runner's shape (`runner_shape` on the run's buckets, the runner's context
    floor included) plus its kind's overhead."""
    cfg = make_config("chunked", num_slots=3, backend="simulator", clock="priced")
    cfg.policy.token_budget = 64
    cfg.hardware = dataclasses.replace(_preset("hardware", "h100_sxm", HardwareConfig),
                                       padded=True, pass_overhead_us=5.0,
                                       prefill_overhead_us=7.0, mixed_overhead_us=11.0)  # fmt: skip
    w = make_workload([40, 7, 90, 12], [5, 9, 4, 6])
    rec = simulate(cfg, w).record
    spec, hw = cfg.model.spec(), hardware(cfg)
    buckets = build_backend(cfg, w, memory_spec(cfg)).buckets
    assert buckets.min_context == 64 and set(rec.kind) == {DECODE, MIXED}
    for p in range(rec.num_passes):
        plan = Plan(rec.req[p], rec.num_tokens[p], rec.start_pos[p], np.int32(rec.kind[p]),
                    np.float32(0), None)  # fmt: skip
        shape = runner_shape(buckets, plan, np)
        assert int(shape.context) == rec.context[p] >= 64
        work = pass_work(spec, plan.num_tokens, plan.start_pos, plan.num_tokens > 0, 1, shape)
        want = sum(np.maximum(np.asarray(f) / (hw.peak_flops * 0.7),
                              np.asarray(b) / (hw.memory_bandwidth * 0.9)).sum()
                   for f, b in work.values())  # fmt: skip
        want += (5.0 + (11.0 if rec.kind[p] == MIXED else 0.0)) * 1e-6
        assert rec.duration[p] == pytest.approx(want, rel=1e-5), p


@pytest.mark.parametrize("overlap", [0.0, 0.75, 1.0])
def test_calibration_recovers_the_efficiencies_that_made_the_times(overlap):
    spec = ModelConfig().spec()
    plans = [(slots, plan) for _, slots, plan in shapes()]
    padded = [runner_shape(Buckets(slots, spec.max_len, 16, 512, 64), p, np) for slots, p in plans]
    terms = [_terms(spec, plan, shape) for (_, plan), shape in zip(plans, padded)]
    kinds = np.array([int(plan.kind) for _, plan in plans])
    assert [(kinds == k).sum() for k in (DECODE, PREFILL, MIXED)] == [9 + 2, 9, 8]
    grid, attention_grid = np.geomspace(0.002, 1.0, 120), np.geomspace(0.02, 2.0, 120)
    # Times from a known entry, on the fit's grids: a decode's overhead, each other kind's more.
    ce, me, ae, overheads = grid[70], grid[100], attention_grid[40], (2e-4, 3e-4, 1e-3)
    times = predict(terms, kinds, 20e9, 100e9, ce, me, ae, overlap, *overheads)
    # The fit's prices are the simulator's: `price` on that entry (padded) gives the same times.
    hw = Hardware("fit", 100e9, 20e9, 1e9, 1.0, ce, me, overheads[0], ae, True, overheads[1],
                  overheads[2], overlap)  # fmt: skip
    priced = [float(price(spec, hw, p.num_tokens, p.start_pos, p.num_tokens > 0, 1, shape,
                          p.kind)) for (_, p), shape in zip(plans, padded)]  # fmt: skip
    np.testing.assert_allclose(priced, times, rtol=1e-5)
    got = fit(terms, times, kinds, 20e9, 100e9)
    assert got[:4] == (pytest.approx(ce), pytest.approx(me), pytest.approx(ae), overlap)
    assert got[4:] == tuple(pytest.approx(x, rel=1e-6) for x in overheads)
    np.testing.assert_allclose(predict(terms, kinds, 20e9, 100e9, *got), times, rtol=1e-6)


def test_metrics_name_the_hardware_a_run_was_priced_for(tmp_path):
    cfg = _with("llama3_8b", "h200", tp=2)
    cfg.workload.num_requests = 4
    m = execute(cfg, tmp_path)
    assert (m["clock"], m["hardware"], m["tensor_parallel"]) == ("priced", "h200", 2)
    assert m["num_finished"] == 4 and m["duration_s"] > 0
    spec = cfg.model.spec()
    assert m["kv_budget_tokens"] == kv_budget_tokens(spec, hardware(cfg), 2)


@pytest.mark.parametrize("paged", [False, True], ids=["slot", "paged"])
def test_the_positions_a_flat_pass_tiles_read_by_hand(paged):
    """`Buckets.tile_context`, the positions a flat pass's query tiles read (the runner skips the
    cache's segments no prompt chunk's row sees; `test_mixed` checks that it computes the
    same): slot segments [0, 64), [64, 128), [128, 256), [256, 1024); a paged read is one."""
    buckets = Buckets(4, 1024, 16, 512, 0 if paged else 64)

    def read(starts, tokens, context):
        plan = Plan(np.arange(4, dtype=np.int32), np.asarray(tokens, np.int32),
                    np.asarray(starts, np.int32), np.int32(MIXED), np.float32(0), None)  # fmt: skip
        return int(buckets.tile_context(plan, context)), int(
            runner_shape(buckets, jax.tree.map(jnp.asarray, plan)).tile_context
        )

    # (chunk starts, tokens per slot, context bucket) -> slot, paged
    cases = [
        ([255, 0, 0, 0], [1, 40, 0, 0], 256, 0, 0),  # a decode and a first chunk
        ([255, 70, 0, 0], [1, 40, 30, 0], 256, 128, 256),  # sees 0..69: to 128
        ([255, 128, 0, 0], [1, 40, 0, 0], 256, 128, 256),  # sees 0..127
        ([255, 129, 0, 0], [1, 40, 0, 0], 256, 256, 256),  # one more: the next segment
        ([300, 10, 40, 0], [1, 5, 20, 0], 512, 64, 512),  # the furthest chunk's segment
        ([500, 490, 0, 0], [1, 9, 0, 0], 512, 512, 512),  # at most the context
        ([255, 300, 0, 0], [1, 1, 0, 0], 512, 0, 0),  # one token a slot: no tile rows
    ]
    for starts, tokens, context, slot, pages in cases:
        want = pages if paged else slot
        assert read(starts, tokens, context) == (want, want), (starts, tokens, context)
