"""The simulator's device loop against the host loop: the same plans, pass for pass, for every
policy, with arrivals, on the passes and the priced clocks, and under paged preemption."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies

from jaxbatch import device_loop, sweep_loop
from jaxbatch.backend.simulator import Simulator
from jaxbatch.config import HardwareConfig, MemoryConfig, ModelConfig
from jaxbatch.device_loop import run_device
from jaxbatch.run import simulate, simulate_sweep, sweep_key
from jaxbatch.sched.policies import PolicyParams, make_policy
from jaxbatch.sched.state import FINISHED, IDLE, REJECTED, init_state
from jaxbatch.sweep_loop import run_sweep
from tests.conftest import make_config, make_workload

H100 = HardwareConfig(name="h100_sxm", peak_tflops=989, memory_gb_s=3350, memory_gb=80,
                      link_gb_s=900)  # fmt: skip


def model_1b() -> ModelConfig:
    """A 1B-parameter model for the priced clock: passes of milliseconds on the H100 (a new
    config each call: a run's validation may fill in its fields)."""
    return dataclasses.replace(ModelConfig(), n_layers=16, d_model=2048, n_heads=16,
                               n_kv_heads=8, d_mlp=5632, dtype="bfloat16")  # fmt: skip


PROMPTS = [40, 7, 120, 33, 9, 64, 18, 90]
BUDGETS = [12, 30, 5, 20, 8, 15, 25, 3]
ARRIVALS = [0.0, 0.0, 1.5, 2.0, 2.0, 7.25, 9.0, 30.0]
RECORD_FIELDS = ("kind", "req", "num_tokens", "start_pos", "holder", "emits", "kv_tokens",
                 "kv_reserved", "rows", "row_tokens", "context")  # fmt: skip


def _both(cfg, w):
    """The run of `cfg` on the host loop and on the device loop (the simulator's `auto` loop is
    the device loop: a config left at it would run there twice)."""
    host, device = (dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, loop=loop))
                    for loop in ("host", "device"))  # fmt: skip
    return simulate(host, w), simulate(device, w)


@pytest.mark.parametrize("clock", ["passes", "priced"])
@pytest.mark.parametrize("policy", ["static", "continuous", "orca", "chunked"])
def test_device_loop_plans_equal_host_loop_plans(policy, clock):
    cfg = make_config(policy, num_slots=3, backend="simulator", clock=clock)
    cfg.policy.token_budget = 128
    cfg.policy.max_wait_s = 1.0 if policy == "static" else 0.0
    if clock == "priced":  # passes of milliseconds, arrivals seconds apart
        cfg.model = model_1b()
        cfg.hardware = H100
        arrivals = [a * 0.01 for a in ARRIVALS]
    else:
        arrivals = ARRIVALS
    host, device = _both(cfg, make_workload(PROMPTS, BUDGETS, arrival=arrivals))
    h, d = host.record, device.record
    assert d.num_passes == h.num_passes > len(PROMPTS)
    for field in RECORD_FIELDS:
        np.testing.assert_array_equal(getattr(d, field), getattr(h, field), err_msg=field)
    np.testing.assert_allclose(d.start, h.start, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(d.duration, h.duration, rtol=1e-5)
    np.testing.assert_array_equal(device.final.num_generated, host.final.num_generated)


@settings(max_examples=8, deadline=None)
@given(strategies.randoms(use_true_random=False))
def test_random_configs_run_alike_on_both_loops_and_in_a_sweep(rnd):
    """Random configs (every policy and queue order, both clocks, paged memory under budgets
    that preempt or contiguous, bursty arrivals with priorities): the host and device loops make
    the same passes, each request's outputs are the passes that emitted for it, and two members
    of a sweep (arrivals at half and twice the rate; if paged, the second with one more block)
    equal their runs one by one. A scratch probe of this kind found three bugs on 2026-12-07
    (twenty-fifth session: outputs counted twice after a recomputation in pieces, orca stranding
    a long recomputation, the host loop recording shapes it did not price); with the last of those
    undone (the simulator dispatching decodes ahead), 2 of 24 draws of this test fail, so each
    run of the suite has about a half chance to see such a bug, and every run draws anew."""
    rng = np.random.default_rng(rnd.randrange(2**32))
    policy = str(rng.choice(["static", "continuous", "orca", "chunked"]))
    clock = str(rng.choice(["passes", "priced"]))
    n = int(rng.integers(8, 25))
    arrival = np.sort(rng.exponential(2.0, n) * (rng.random(n) < 0.7))  # some at once
    cfg = make_config(policy, num_slots=int(rng.integers(2, 7)), backend="simulator", clock=clock)
    cfg.policy.queue = str(rng.choice(["fcfs", "spf", "priority"]))
    cfg.policy.token_budget = int(rng.choice([64, 128, 256]))
    cfg.policy.long_prefill_threshold = int(rng.choice([0, 16, 48]))
    cfg.policy.max_wait_s = float(rng.choice([0.0, 0.5])) if policy == "static" else 0.0
    paged = bool(rng.random() < 0.7)
    budget = int(rng.integers(9, 25)) * 16 if paged else 4096
    if clock == "priced":  # passes of milliseconds, arrivals seconds apart
        cfg.model = model_1b()
        cfg.hardware = H100
        arrival = arrival * 0.01
    layout = "paged" if paged else "contiguous"
    cfg.memory = MemoryConfig(layout=layout, budget_tokens=budget, block_size=16,
                              watermark=float(rng.choice([0.0, 0.05])))  # fmt: skip
    w = make_workload(rng.integers(1, 120, n), rng.integers(1, 40, n), arrival=arrival)
    w = dataclasses.replace(w, priority=rng.integers(0, 3, n))
    host, device = _both(cfg, w)
    for field in RECORD_FIELDS:
        np.testing.assert_array_equal(getattr(device.record, field), getattr(host.record, field),
                                      err_msg=field)  # fmt: skip
    for res in (host, device):
        status, made = np.asarray(res.final.status), np.asarray(res.final.num_generated)
        assert np.isin(status, [FINISHED, REJECTED]).all()  # every request ends with a status
        np.testing.assert_array_equal(status, np.asarray(host.final.status))
        rec = res.record
        np.testing.assert_array_equal(np.bincount(rec.req[rec.emits], minlength=n), made)
        np.testing.assert_array_equal(made[status == FINISHED], w.max_new[status == FINISHED])
    members = []
    for scale, more in ((0.5, 0), (2.0, 16 if paged else 0)):
        memory = dataclasses.replace(cfg.memory, budget_tokens=budget + more)
        engine = dataclasses.replace(cfg.engine, loop="device")
        c = dataclasses.replace(cfg, engine=engine, memory=memory)
        members.append((c, dataclasses.replace(w, arrival=w.arrival * scale)))
    assert len({sweep_key(c) for c, _ in members}) == 1
    swept = simulate_sweep([c for c, _ in members], [x for _, x in members])
    for (c, x), got in zip(members, swept):
        alone = simulate(c, x)
        for field in RECORD_FIELDS:
            np.testing.assert_array_equal(getattr(got.record, field),
                                          getattr(alone.record, field), err_msg=field)  # fmt: skip


def test_device_loop_equals_host_loop_under_paged_preemption():
    cfg = make_config("chunked", num_slots=3, backend="simulator", clock="passes")
    cfg.policy.token_budget = 32
    cfg.memory = MemoryConfig(layout="paged", budget_tokens=160, block_size=16, watermark=0.0)
    host, device = _both(cfg, make_workload([40, 35, 50, 20], [30, 30, 25, 30]))
    assert np.asarray(host.final.num_preemptions).sum() > 0
    for field in ("kind", "req", "num_tokens", "start_pos", "holder", "kv_reserved"):
        np.testing.assert_array_equal(getattr(device.record, field), getattr(host.record, field))
    np.testing.assert_array_equal(device.final.num_preemptions, host.final.num_preemptions)


def test_the_simulators_host_loop_records_each_pass_at_its_plans_own_shape():
    """Chunked prefill, priorities and paged preemption on 3 slots: a preemption can leave a
    decode feeding fewer slots than the host loop foresaw. The runner's host loop dispatches the
    next decode before it sees the plan, at a shape guessed from every slot's next position, and
    records that shape (it is what ran); the simulator runs nothing, so its host loop prices and
    records each pass at its plan's own shape, as its device loop does. It once recorded one
    decode here at context 256, the guess, where the plan's own (and the price's) is 128."""
    prompts = [99, 62, 18, 100, 62, 19, 17, 49, 82, 49, 101, 1, 51, 63, 114, 29]
    budgets = [33, 3, 14, 30, 23, 37, 30, 36, 33, 6, 37, 33, 6, 39, 30, 13]
    arrival = [0.0, 0.0, 0.33, 0.421, 0.484, 0.49, 0.677, 1.014, 1.237, 1.295, 1.72, 1.847, 2.1,
               3.104, 3.338, 3.936]  # fmt: skip
    priority = np.array([0, 0, 2, 2, 2, 2, 2, 2, 2, 1, 2, 0, 1, 2, 2, 1])
    cfg = make_config("chunked", num_slots=3, backend="simulator", clock="passes")
    cfg.policy.queue, cfg.policy.token_budget = "priority", 128
    cfg.policy.long_prefill_threshold = 16
    cfg.memory = MemoryConfig(layout="paged", budget_tokens=256, block_size=16, watermark=0.05)
    w = dataclasses.replace(make_workload(prompts, budgets, arrival=arrival), priority=priority)
    host, device = _both(cfg, w)
    assert np.asarray(host.final.num_preemptions).sum() == 6
    for field in RECORD_FIELDS:
        np.testing.assert_array_equal(getattr(device.record, field), getattr(host.record, field),
                                      err_msg=field)  # fmt: skip


# sweep_bytes: one segment, or drained every 16 iterations; min_lanes 8: 3 members at once, 1:
# narrowed to 1 once 1 runs; groups 2: split by `_split` (min_lanes 1: members 0 and 2 on one
# thread, 1 on another; 8: 1 and 2, and 0). Expected: the lanes each narrowing kept (of the
# slowest arrivals' member, 2).
@pytest.mark.parametrize(
    "sweep_bytes, min_lanes, groups, kept",
    [(1 << 28, 8, 1, []), (1, 8, 1, []), (1 << 28, 1, 1, [[2]]), (1, 1, 1, [[2]]),
     (1, 1, 2, [[1]]), (1 << 28, 8, 2, [])],
)  # fmt: skip
def test_vmapped_members_equal_the_same_runs_one_by_one(
    monkeypatch, sweep_bytes, min_lanes, groups, kept
):
    """Three arrival processes (a rate sweep) as one program (`run_sweep`), field for field,
    also when the sweep narrows to its last running member, and in groups of members stepped
    by their own threads."""
    monkeypatch.setattr(sweep_loop, "SWEEP_BYTES", sweep_bytes)
    monkeypatch.setattr(sweep_loop, "MIN_LANES", min_lanes)
    narrowed, narrow = [], sweep_loop._narrow  # what each call of `_narrow` kept
    monkeypatch.setattr(
        sweep_loop, "_narrow", lambda *a: narrowed.append(narrow(*a)) or narrowed[-1]
    )
    policy, params = make_policy("continuous"), PolicyParams()
    n = len(PROMPTS)

    def state(scale):
        arrival = np.array(ARRIVALS) * scale
        return init_state(arrival, np.array(PROMPTS), np.array(BUDGETS), np.zeros(n, bool), 3)

    states = [state(s) for s in (0.1, 1.0, 4.0)]
    sim = Simulator(3, 256)  # the passes clock
    together = run_sweep(policy, [params] * 3, states, [sim] * 3, 512, groups)
    assert max(r.record.num_passes for r in together) > 2 * 16
    for st, member in zip(states, together, strict=True):
        alone = run_device(policy, params, st, sim, 512)
        for a, b in zip(jax.tree.leaves(alone.final), jax.tree.leaves(member.final)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        for field in RECORD_FIELDS + ("start", "duration"):
            np.testing.assert_array_equal(
                getattr(alone.record, field), getattr(member.record, field), err_msg=field
            )
    assert len({r.record.num_passes for r in together}) == 3  # really different runs
    assert [list(k) for k in narrowed if k is not None] == kept
    # The same sweep again in the process: its programs kept, nothing compiled, the same runs.
    again = run_sweep(policy, [params] * 3, states, [sim] * 3, 512, groups)
    assert again[0].num_compiles == 0
    for first, second in zip(together, again, strict=True):
        for field in RECORD_FIELDS + ("start", "duration"):
            np.testing.assert_array_equal(getattr(first.record, field),
                                          getattr(second.record, field))  # fmt: skip


def test_members_whose_last_requests_arrive_latest_share_a_group_with_the_earliest():
    """`_split`: member i in group i % g where every member's last request arrives at once (an
    offline sweep, or one over budgets); else the MIN_LANES latest and the earliest fill group 0
    and the others the other groups in turn. Every member in exactly one group."""
    np.testing.assert_array_equal(np.concatenate(sweep_loop._split([0.0] * 5, 2)), [0, 2, 4, 1, 3])
    last = np.geomspace(0.25, 4.0, 64)[::-1]  # member 0 arrives latest
    first, second = sweep_loop._split(list(last), 2)
    assert first.tolist() == [*range(8), *range(40, 64)] and second.tolist() == list(range(8, 40))
    groups = sweep_loop._split(list(np.arange(40.0)), 3)
    assert [len(x) for x in groups] == [14, 13, 13]
    assert groups[0].tolist() == [*range(6), *range(32, 40)]
    assert sorted(np.concatenate(groups).tolist()) == list(range(40))


@pytest.mark.parametrize("queue", ["fcfs", "spf", "priority"])
def test_a_sweep_admits_at_every_width_as_its_runs_do_one_by_one(queue):
    """16 slots: a vmapped sweep admits at width 1, 2, 8 or 16, the narrowest that holds the
    most any member admits on that step, or not at all (`policies._admission`). Bursts of 1, 2,
    5 and 12 requests, spread apart by a scale per member, so that on one step members admit
    different numbers; each member equals its own run, field for field, in every queue order."""
    sizes = [12, 1, 2, 5, 1, 2, 12]
    arrival = np.concatenate([np.full(k, 40.0 * i) for i, k in enumerate(sizes)])
    n = len(arrival)
    rng = np.random.default_rng(0)
    prompts, budgets = rng.integers(1, 60, n), rng.integers(1, 40, n)
    priority = rng.integers(0, 3, n)
    widths = set()
    policy, params = make_policy("continuous", queue), PolicyParams()
    states = [init_state(arrival * s, prompts, budgets, np.zeros(n, bool), 16, priority)
              for s in (1.0, 0.5, 1.7)]  # fmt: skip
    sim = Simulator(16, 256)  # the passes clock
    together = run_sweep(policy, [params] * 3, states, [sim] * 3, 2048, 1)
    for st, member in zip(states, together, strict=True):
        alone = run_device(policy, params, st, sim, 2048)
        for field in RECORD_FIELDS + ("start", "duration"):
            np.testing.assert_array_equal(
                getattr(alone.record, field), getattr(member.record, field), err_msg=field
            )
        np.testing.assert_array_equal(alone.final.admit_order, member.final.admit_order)
        holder = alone.record.holder
        entered = ((holder >= 0) & (np.roll(holder, 1, axis=0) != holder))[1:].sum(axis=1)
        widths |= set(np.concatenate([[(holder[0] >= 0).sum()], entered]).tolist())
    assert {1, 2, 5, 12} <= widths  # every width's path ran


@pytest.mark.parametrize("policy", ["static", "continuous", "orca", "chunked"])
def test_an_ended_run_is_a_fixed_point_of_schedule_and_commit(policy):
    """A sweep steps its ended members on with the others, their states unselected
    (`device_loop.advance`): an ended run, scheduled again at its clock, plans an idle pass
    with no wake, and that plan's commit leaves its state field for field as it was. Arrivals,
    and paged memory (continuous and chunked preempt in it)."""
    cfg = make_config(policy, num_slots=3, backend="simulator", clock="passes")
    cfg.policy.token_budget = 32
    cfg.policy.max_wait_s = 1.0 if policy == "static" else 0.0
    cfg.memory = MemoryConfig(layout="paged", budget_tokens=160, block_size=16, watermark=0.0)
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, loop="device"))
    res = simulate(cfg, make_workload(PROMPTS, BUDGETS, arrival=ARRIVALS))
    assert res.record.num_passes > len(PROMPTS)
    preempted = int(np.asarray(res.final.num_preemptions).sum())
    assert preempted > 0 if policy in ("continuous", "chunked") else preempted == 0
    ended = jax.tree.map(jax.numpy.asarray, res.final)
    params = PolicyParams(token_budget=np.int32(32), max_wait_s=np.float32(1.0))
    again, plan = jax.jit(make_policy(policy).schedule)(ended, params)
    assert int(plan.kind) == IDLE and not np.isfinite(float(plan.wait_until))  # no wake
    again = jax.jit(make_policy(policy).commit)(again, plan, np.zeros(3, np.int32), params)
    for a, b in zip(jax.tree.leaves(ended), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("groups", [1, 2])
def test_a_run_past_max_passes_is_refused_not_cut_short(groups):
    """A sweep whose member reaches max_passes (its loop then stops every member) is refused,
    naming an unfinished member, as run_device refuses its run: nothing is returned cut short."""
    policy, params = make_policy("continuous"), PolicyParams()
    n = len(PROMPTS)
    states = [init_state(np.array(ARRIVALS) * s, np.array(PROMPTS), np.array(BUDGETS),
                         np.zeros(n, bool), 3) for s in (0.1, 1.0, 4.0)]  # fmt: skip
    sim = Simulator(3, 256)
    with pytest.raises(RuntimeError, match="did not end within max_passes=10"):
        run_device(policy, params, states[0], sim, 10)
    with pytest.raises(RuntimeError, match=r"sweep member \d did not end within max_passes=10"):
        run_sweep(policy, [params] * 3, states, [sim] * 3, 10, groups)
    # The limit itself is allowed: a run of exactly max_passes passes ends and is returned, in a
    # sweep too, where the other members end with fewer passes (and more idle iterations).
    needed = [run_device(policy, params, st, sim, 1000).record.num_passes for st in states]
    assert len(set(needed)) > 1
    assert run_device(policy, params, states[0], sim, needed[0]).record.num_passes == needed[0]
    with pytest.raises(RuntimeError, match=f"did not end within max_passes={needed[0] - 1}"):
        run_device(policy, params, states[0], sim, needed[0] - 1)
    swept = run_sweep(policy, [params] * 3, states, [sim] * 3, max(needed), groups)
    assert [r.record.num_passes for r in swept] == needed


def test_a_record_drained_from_a_small_buffer_is_the_whole_record(monkeypatch):
    cfg = make_config("chunked", num_slots=3, backend="simulator", clock="passes")
    cfg.policy.token_budget = 64
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, loop="device"))
    w = make_workload(PROMPTS, BUDGETS, arrival=ARRIVALS)
    whole = simulate(cfg, w)
    monkeypatch.setattr(device_loop, "BUFFER", 7)  # drained every 7 passes
    drained = simulate(cfg, w)
    assert whole.record.num_passes > 3 * 7
    for field in ("start", "kind", "req", "num_tokens", "start_pos", "holder", "kv_reserved"):
        np.testing.assert_array_equal(getattr(drained.record, field), getattr(whole.record, field))


def test_a_sweep_over_traced_knobs_and_paged_budgets_equals_its_runs_one_by_one():
    """Token budget (three row buckets), long-prefill threshold, paged memory budget (a pool
    sized for the largest, under preemption) and watermark vary across the members of one
    program; each member equals its own run, field for field, on the priced clock."""
    base = make_config("chunked", num_slots=3, backend="simulator", clock="priced")
    base.model = model_1b()
    base.hardware = dataclasses.replace(H100, padded=True)  # prices the row buckets
    base = dataclasses.replace(base, engine=dataclasses.replace(base.engine, loop="device"))
    knobs = [(32, 0, 128, 0.0), (64, 16, 160, 0.0), (128, 8, 224, 0.05), (48, 0, 144, 0.1)]
    cfgs = []
    for budget, threshold, blocks_tokens, watermark in knobs:
        cfg = dataclasses.replace(base, policy=dataclasses.replace(base.policy))
        cfg.policy.token_budget, cfg.policy.long_prefill_threshold = budget, threshold
        cfg.memory = MemoryConfig(layout="paged", budget_tokens=blocks_tokens, block_size=16,
                                  watermark=watermark)  # fmt: skip
        cfgs.append(cfg)
    assert len({sweep_key(c) for c in cfgs}) == 1
    w = make_workload([40, 35, 50, 20, 9, 64], [30, 30, 25, 30, 12, 8],
                      arrival=[0.0, 0.0, 0.0, 0.0, 0.02, 0.05])  # fmt: skip
    together = simulate_sweep(cfgs, [w] * len(cfgs))
    preempted = 0
    for cfg, member in zip(cfgs, together, strict=True):
        alone = simulate(cfg, w)
        preempted += int(np.asarray(alone.final.num_preemptions).sum())
        for field in RECORD_FIELDS:
            np.testing.assert_array_equal(
                getattr(member.record, field), getattr(alone.record, field), err_msg=field
            )
        np.testing.assert_allclose(member.record.start, alone.record.start, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(member.record.duration, alone.record.duration)
        np.testing.assert_array_equal(member.final.status, alone.final.status)
    assert preempted > 0
    assert len({r.record.num_passes for r in together}) == len(cfgs)


def test_a_simulated_run_of_a_program_already_compiled_compiles_nothing_and_runs_alike():
    """Runs one after another in a process share a simulator's compiled device loop (a run's
    state and knobs are its inputs): the second compiles nothing and equals the same run on a
    freshly compiled program; another token budget (another bucket) compiles its own."""
    cfg = make_config("chunked", num_slots=3, backend="simulator", clock="passes", loop="device")
    cfg.policy.token_budget = 64
    first = make_workload(PROMPTS, BUDGETS, arrival=ARRIVALS)
    later = make_workload(PROMPTS[::-1], BUDGETS, arrival=np.array(ARRIVALS) * 3)

    def afresh():  # forget the kept programs, and JAX's: the next run compiles
        device_loop.clear_programs()
        jax.clear_caches()

    afresh()
    assert simulate(cfg, first).num_compiles > 0
    again = simulate(cfg, later)
    assert again.num_compiles == 0
    cfg.policy.long_prefill_threshold = 16  # a traced knob: the same program
    knob = simulate(cfg, later)
    assert knob.num_compiles == 0
    for kept, threshold in ((again, 0), (knob, 16)):
        afresh()
        cfg.policy.long_prefill_threshold = threshold
        fresh = simulate(cfg, later)
        assert fresh.num_compiles > 0
        for field in (*RECORD_FIELDS, "start"):
            np.testing.assert_array_equal(getattr(kept.record, field), getattr(fresh.record, field))
    assert not np.array_equal(again.record.num_tokens, knob.record.num_tokens)
    cfg.policy.token_budget = 256  # the mixed passes' top row bucket is the program's
    assert simulate(cfg, later).num_compiles > 0
