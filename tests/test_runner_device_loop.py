"""The device loop on the runner against the host loop: identical tokens and schedule for every
request, offline and with arrivals, through `run.simulate` and through the `engine.loop=device`
config."""

from __future__ import annotations

import csv
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies

from jaxbatch.backend import compilation, executables
from jaxbatch.backend.runner import prefill_rows
from jaxbatch.cli import execute
from jaxbatch.config import ConfigError, LengthConfig, MemoryConfig, WorkloadConfig, validate
from jaxbatch.device_loop import clear_programs, run_device
from jaxbatch.run import build_backend, memory_spec, runner_step, simulate
from jaxbatch.sched.policies import PolicyParams, built_in, make_policy
from jaxbatch.sched.state import FINISHED, PREFILL, REJECTED, Plan, init_state
from tests.conftest import make_config, make_workload


def _device(cfg, w):
    """The same config and workload through the device loop."""
    return simulate(
        dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, loop="device")), w
    )


def _same_run(device, host):
    assert (np.asarray(device.final.status) == FINISHED).all()
    assert len(device.outputs) == len(host.outputs)
    for a, b in zip(device.outputs, host.outputs):
        np.testing.assert_array_equal(a, b)
    # Same schedule: the same passes, the same tokens fed in each, the same KV accounting.
    for field in ("kind", "num_tokens", "start_pos", "holder", "emits", "kv_tokens"):
        np.testing.assert_array_equal(getattr(device.record, field), getattr(host.record, field))


@pytest.mark.parametrize("policy", ["static", "continuous", "chunked", "orca"])
def test_device_loop_equals_host_loop_with_arrivals(policy):
    """Requests arriving while others run, and a gap with nothing to do: on the passes clock the
    device loop waits (an idle plan jumps the clock, running no pass) exactly as the host loop.
    Two requests arrive together at 2, the last long after the rest end; the offline case is
    `test_device_loop_from_the_config` and the paged test below. Chunked prompts of over 16
    tokens go in chunks."""
    w = make_workload([30, 7, 45, 12, 3], [6, 9, 4, 7, 5], arrival=[0.0, 2.0, 2.0, 9.0, 60.0])
    cfg = make_config(policy, num_slots=3, clock="passes")
    cfg.policy.token_budget = 64
    cfg.policy.long_prefill_threshold = 16
    cfg.policy.max_wait_s = 3.0 if policy == "static" else 0.0  # static waits to fill a batch
    device, host = _device(cfg, w), simulate(cfg, w)
    _same_run(device, host)
    np.testing.assert_array_equal(device.record.start, host.record.start)
    assert device.record.start[-1] > 60  # the last request arrived after a wait
    ran = device.record.rows * device.record.row_tokens
    assert (ran >= device.record.num_tokens.sum(1)).all()  # each shape holds its pass


def test_device_loop_equals_host_loop_with_paged_preemption():
    """The paged layout under a budget tight enough to preempt: the device loop frees, regrants
    and recomputes exactly as the host loop does."""
    w = make_workload([40, 35, 50, 20], [30, 30, 25, 30])
    cfg = make_config("chunked", num_slots=3, clock="passes")
    cfg.policy.token_budget = 32
    cfg.memory = MemoryConfig(layout="paged", budget_tokens=160, block_size=16, watermark=0.0)
    host = simulate(cfg, w)
    assert np.asarray(host.final.num_preemptions).sum() > 0
    device = _device(cfg, w)
    _same_run(device, host)
    np.testing.assert_array_equal(device.final.num_preemptions, host.final.num_preemptions)


@settings(max_examples=2, deadline=None)
@given(strategies.randoms(use_true_random=False))
def test_random_configs_give_the_same_tokens_on_both_loops_and_with_memory_for_all(rnd):
    """Random runner configs (every policy and queue order, paged budgets that preempt or
    contiguous, decodes of few slots, arrivals with priorities) with an EOS: the token an
    ample-memory continuous run draws most, so the plans depend on the tokens (no fixed test
    runs EOS on the runner's device loop, which then compiles every shape). The two
    loops make the same passes and tokens, and every finished request's tokens are the ample
    run's, cut at its EOS. A pass's shape may be larger on the host loop only: after a
    preemption or an EOS it may run the decode it dispatched ahead, at the shape it guessed
    (README, Loops). A scratch probe of 80 such configs (26 with an EOS) found no difference
    (2026-12-07). Two draws a suite run: each compiles its own passes and device loop."""
    rng = np.random.default_rng(rnd.randrange(2**32))
    n = int(rng.integers(4, 12))
    prompt, budget = rng.integers(1, 88, n), rng.integers(1, 40, n)  # within max_len 128
    w = make_workload(
        prompt, budget, arrival=np.sort(rng.exponential(3.0, n) * (rng.random(n) < 0.6))
    )
    w = dataclasses.replace(w, priority=rng.integers(0, 3, n))
    ample = make_config("continuous", num_slots=4, clock="passes")
    ample.model = dataclasses.replace(ample.model, max_len=128)  # fewer shapes to compile
    ample = simulate(ample, w)
    eos = int(np.bincount(np.concatenate(ample.outputs)).argmax())
    policy = str(rng.choice(["static", "continuous", "orca", "chunked"]))
    cfg = make_config(policy, num_slots=4, clock="passes", decode_rows="compact", eos_id=eos)
    cfg.model = dataclasses.replace(cfg.model, max_len=128)
    cfg.policy.queue = str(rng.choice(["fcfs", "spf", "priority"]))
    cfg.policy.token_budget = 64
    cfg.policy.long_prefill_threshold = int(rng.choice([0, 16]))
    cfg.policy.max_wait_s = 2.0 if policy == "static" else 0.0
    if rng.random() < 0.7:
        cfg.memory = MemoryConfig(layout="paged", budget_tokens=int(rng.integers(7, 14)) * 16,
                                  block_size=16, watermark=0.0)  # fmt: skip
    host = simulate(cfg, w)
    device = _device(cfg, w)
    status = np.asarray(host.final.status)
    assert np.isin(status, [FINISHED, REJECTED]).all()  # every request ends with a status
    np.testing.assert_array_equal(np.asarray(device.final.status), status)
    for field in ("kind", "req", "num_tokens", "start_pos", "holder", "emits", "kv_tokens",
                  "kv_reserved"):  # fmt: skip
        np.testing.assert_array_equal(getattr(device.record, field), getattr(host.record, field))
    for field in ("rows", "context"):
        assert (getattr(host.record, field) >= getattr(device.record, field)).all()
    for i in range(n):
        np.testing.assert_array_equal(device.outputs[i], host.outputs[i])
        want = ample.outputs[i]
        if (want == eos).any():
            want = want[: np.argmax(want == eos) + 1]
        if status[i] == FINISHED:
            np.testing.assert_array_equal(host.outputs[i], want)


def _cli_config(loop: str, clock: str):
    cfg = make_config("chunked", num_slots=4, clock=clock, loop=loop, warmup=True,
                      decode_rows="compact")  # fmt: skip
    cfg.policy.token_budget = 32
    cfg.workload = WorkloadConfig(
        num_requests=8, prompt=LengthConfig(dist="uniform", low=4, high=60),
        output=LengthConfig(dist="uniform", low=1, high=30),
    )  # fmt: skip
    cfg.output.tokens = True
    return cfg


def test_device_loop_from_the_config(tmp_path):
    """`engine.loop=device` writes the same outputs as the host loop; on the passes clock its
    metrics are the host loop's. Measured, its passes share the loop's wall time evenly and
    metrics.json gives the latencies in passes too."""
    runs = {}
    for loop in ("host", "device"):
        out = tmp_path / loop
        runs[loop] = execute(_cli_config(loop, "passes"), out)
        runs[loop]["tokens"] = (out / "tokens.jsonl").read_text()
        with (out / "passes.csv").open() as f:
            runs[loop]["shapes"] = [(p["kind"], p["rows"]) for p in csv.DictReader(f)]
    host, device = runs["host"], runs["device"]
    assert device["tokens"] == host["tokens"]
    # the same shapes, decodes of one of the four slots at one row among them
    assert device["shapes"] == host["shapes"] and ("decode", "1") in device["shapes"]
    for key in ("num_finished", "num_passes", "output_tokens", "ttft_s", "tpot_s", "e2e_s"):
        assert device[key] == host[key], key
    m = execute(_cli_config("device", "measured"), tmp_path / "measured")
    assert m["loop"] == "device" and m["compiles_after_warmup"] == 0
    assert m["duration_s"] == pytest.approx(m["wall_s"])
    assert m["mean_pass_s"] == pytest.approx(m["wall_s"] / m["num_passes"])
    assert m["in_passes"]["ttft"] == device["ttft_s"]  # same schedule, counted in passes
    p50 = m["in_passes"]["e2e"]["p50"] * m["mean_pass_s"]
    assert m["e2e_s"]["p50"] == pytest.approx(p50)
    saved = json.loads((tmp_path / "measured" / "metrics.json").read_text())
    assert saved["in_passes"] == m["in_passes"]


@pytest.mark.parametrize(
    "change, expect",
    [
        (
            {"arrival": "poisson", "clock": "measured"},
            "with engine.clock=measured needs an offline",
        ),
        ({"loop": "fused"}, "the fused loop is now loop=device"),
    ],
)
def test_device_loop_config_errors_name_the_field(change, expect):
    cfg = _cli_config(change.get("loop", "device"), change.get("clock", "passes"))
    cfg.workload.arrival = change.get("arrival", "offline")
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert str(err.value).startswith(f"engine.loop='{cfg.engine.loop}' is not valid: ")
    assert expect in str(err.value)


@pytest.mark.parametrize("policy", ["static", "continuous", "chunked", "orca"])
def test_the_simulator_makes_the_runners_plans(policy):
    """The same `sched/` code schedules both backends: with arrivals on the passes clock, the
    simulator's passes are the runner's, pass for pass, on either loop, at the runner's shapes
    (the simulator shares its buckets, the slot cache's context floor included)."""
    w = make_workload([30, 7, 45, 12, 3], [6, 9, 4, 7, 5], arrival=[0.0, 2.0, 2.0, 9.0, 60.0])
    cfg = make_config(policy, num_slots=3, clock="passes")
    cfg.policy.token_budget = 64
    cfg.policy.max_wait_s = 3.0 if policy == "static" else 0.0
    runner = simulate(cfg, w)
    for loop in ("host", "device"):
        engine = dataclasses.replace(cfg.engine, backend="simulator", loop=loop)
        sim = simulate(dataclasses.replace(cfg, engine=engine), w)
        for field in ("start", "kind", "req", "num_tokens", "start_pos", "holder", "kv_tokens",
                      "rows", "row_tokens", "context"):  # fmt: skip
            np.testing.assert_array_equal(getattr(sim.record, field), getattr(runner.record, field))


def test_the_runners_device_loop_compiles_the_shapes_the_host_loop_warms_up():
    """The runner's device-loop step compiles the host loop's pass shapes: with its plans fixed,
    exactly those of the run's passes (a dry run of the host loop, `run.runner_step`), fewer than
    every shape the workload could use; with EOS (plans not fixed) every one of those. A run
    with a pass of a shape not compiled is refused by `check`, not reported with its tokens."""
    cfg = make_config("continuous", num_slots=3)
    w = make_workload([30, 7, 45, 12, 3], [6, 9, 4, 7, 5])
    memory = memory_spec(cfg)
    runner = build_backend(cfg, w, memory)
    policy, params = make_policy("continuous"), PolicyParams()

    def start(workload):
        return init_state(workload.arrival, workload.prompt_len, workload.max_new,
                          np.zeros(len(workload), bool), 3, memory=memory)  # fmt: skip

    state = start(w)
    every = runner.buckets.for_workload(w.prompt_len, w.max_new)
    step, planned = runner_step(runner, policy, params, state, w.arrival, every)
    assert planned
    res = run_device(policy, params, state, step, 4096)
    assert set(step.shapes) == step.needed(res.record) < set(every)
    assert step.num_branches == len(step.shapes)
    step.check(res.record)
    eos_params = PolicyParams(eos_id=np.int32(1))
    eos, planned = runner_step(runner, policy, eos_params, state, w.arrival, every)
    assert not planned and set(eos.shapes) == set(every)
    # compiled for a workload of short prompts only: the real run needs shapes it lacks
    short = make_workload([3, 4], [2, 2])
    narrow, _ = runner_step(runner, policy, params, start(short), short.arrival, every)
    assert not set(narrow.shapes) >= set(step.shapes)
    with pytest.raises(RuntimeError, match="did not compile"):
        narrow.check(run_device(policy, params, state, narrow, 4096).record)


def test_prefill_rows_on_the_device_equal_the_hosts():
    """`prefill_rows` lays out a prefill's rows alike from a host plan (numpy: the host loop) and
    a device plan (jnp: the device loop): the fed slots in slot order, then rows feeding nothing."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        b = 8
        num_tokens = np.where(rng.random(b) < 0.5, rng.integers(1, 40, b), 0).astype(np.int32)
        fed = int((num_tokens > 0).sum())
        rows = min(b, max(1, 1 << (fed - 1).bit_length()))
        plan = Plan(rng.integers(0, 50, b).astype(np.int32), num_tokens,
                    rng.integers(0, 9, b).astype(np.int32), np.int32(PREFILL), np.float32(0),
                    rng.integers(-1, 30, (b, 3)).astype(np.int32))  # fmt: skip
        host = prefill_rows(plan, rows, b)
        device = jax.jit(prefill_rows, static_argnums=(1, 2, 3))(plan, rows, b, jnp)
        for h, d in zip(host, device, strict=True):
            np.testing.assert_array_equal(h, np.asarray(d))
        slot, req, start, length, valid, table = host
        np.testing.assert_array_equal(slot[:fed], np.flatnonzero(num_tokens))
        assert (slot[fed:] == b).all() and (length[fed:] == 0).all() and (table[fed:] == -1).all()
        assert (req[fed:] == 0).all() and (start[fed:] == 0).all() and not valid[fed:].any()
        np.testing.assert_array_equal(length[:fed], num_tokens[num_tokens > 0])


def test_a_later_process_loads_the_device_loops_program_and_runs_it_on_its_own_weights(
    tmp_path, monkeypatch
):
    """The device loop's program is saved whole in the compile cache's store (`executables`) and
    found by a later run without tracing or compiling it, as another process would find it (the
    process's programs dropped). Its weights are inputs, not constants: loaded for a model of
    another seed, it gives the host loop's tokens for that seed. Only `make_policy`'s policies,
    whose code the store's key holds, are named for the store."""
    w = make_workload([30, 7, 45, 12], [6, 9, 4, 7])
    cfg = make_config("continuous", num_slots=2, clock="passes")
    reseeded = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, seed=1))
    host = simulate(reseeded, w)  # the reference, through the session's store
    monkeypatch.setattr(compilation, "_store", [tmp_path])
    first = _device(cfg, w)
    assert first.num_compiles > 0 and len(list(tmp_path.glob("*.exe"))) == 1
    executables.clear()
    clear_programs()  # as in a new process
    again = _device(reseeded, w)
    assert (again.num_compiles, again.cache_hits) == (0, 1)
    _same_run(again, host)
    assert any((a != b).any() for a, b in zip(again.outputs, first.outputs))  # other weights
    assert built_in(make_policy("chunked", "spf")) == ("make_policy", "chunked", "spf")
    own = make_policy("chunked")._replace(schedule=lambda *a: make_policy("chunked").schedule(*a))
    assert built_in(own) is None
