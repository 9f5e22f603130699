"""The host loop: when it waits for a pass mid-iteration, and the decode pass it runs ahead."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbatch import engine
from jaxbatch.backend import compilation
from jaxbatch.backend.buckets import Buckets
from jaxbatch.backend.runner import Runner
from jaxbatch.backend.simulator import Simulator
from jaxbatch.config import MemoryConfig
from jaxbatch.engine import PLANNED_PASSES, fixed_plans, plan_warmup, planned_shapes, run
from jaxbatch.run import _prepare, simulate
from jaxbatch.sched.policies import PolicyParams, make_policy
from jaxbatch.sched.state import DECODE, MIXED, PREFILL, Plan, init_state
from tests.conftest import make_config, make_workload


@pytest.mark.parametrize(
    "policy, arrival, max_wait_s",
    [
        ("continuous", np.zeros(12), 0.0),  # offline: never
        ("continuous", np.linspace(0.0, 0.02, 12), 0.0),  # while arrivals are pending
        ("static", np.linspace(0.0, 0.02, 12), 0.005),  # always: static's wait reads the clock
    ],
)
def test_engine_syncs_mid_pass_exactly_while_the_clock_can_change_a_decision(
    monkeypatch, policy, arrival, max_wait_s
):
    backend = Simulator(num_slots=4, max_len=256)
    syncs = []
    real = jax.block_until_ready

    def counting(x):  # counts only waits on a pass's tokens, not warm-up or final copies
        syncs.append(x is backend._tokens)
        return real(x)

    monkeypatch.setattr(jax, "block_until_ready", counting)
    n = len(arrival)
    state = init_state(arrival, np.full(n, 8), np.full(n, 6), np.zeros(n, bool), 4)
    params = PolicyParams(max_wait_s=np.float32(max_wait_s))
    res = run(make_policy(policy), params, state, backend, [], clock="measured")
    assert res.record.emits.sum() == 6 * n
    # A pass dispatched at clock time `start` waits iff an arrival (as the state holds it, float32)
    # may still come after it starts, or the policy waits on the clock at all.
    last = float(np.asarray(state.arrival).max())
    expect = res.record.num_passes if max_wait_s > 0 else (res.record.start < last).sum()
    assert sum(syncs) == expect
    # Each online case has passes on both sides of the last arrival, so a rule that always or never
    # waited would fail it.
    assert (expect == 0) == (last == 0)
    assert last == 0 or (res.record.start >= last).any()


def _counting_decode(monkeypatch):
    """Record each decode pass the runner runs: True if the engine dispatched it ahead of its
    plan, False if it ran on a plan the host had seen (through `execute`)."""
    calls = []
    decode, execute = Runner.decode, Runner.execute

    def counted_decode(self, plan, shape):
        calls.append(not self._in_execute)
        return decode(self, plan, shape)

    def counted_execute(self, *args):
        self._in_execute = True
        try:
            return execute(self, *args)
        finally:
            self._in_execute = False

    monkeypatch.setattr(Runner, "_in_execute", False, raising=False)
    monkeypatch.setattr(Runner, "decode", counted_decode)
    monkeypatch.setattr(Runner, "execute", counted_execute)
    return calls


def test_decode_dispatched_ahead_is_exact_without_eos_and_harmless_with_it(monkeypatch):
    w = make_workload([5, 30, 12, 60, 9, 33], [10, 3, 17, 6, 12, 8])
    calls = _counting_decode(monkeypatch)
    cfg = make_config("continuous", num_slots=2, clock="passes")
    full = simulate(cfg, w)
    rec = full.record
    decodes = np.flatnonzero(rec.kind == DECODE)
    # Offline and no EOS: every pass run ahead was the right one (one decode call per decode
    # pass), and exactly the decodes after a prefill or decode pass in which no request ended
    # ran ahead (after a prefill too: the host tracks every slot's position).
    ended = {int(np.nonzero((rec.req == i) & rec.emits)[0][-1]) for i in range(6)}
    expect = [p - 1 not in ended for p in decodes]
    assert calls == expect
    assert any(rec.kind[p - 1] == PREFILL for p in decodes[expect])
    assert full.outputs is not None and all(len(o) == m for o, m in zip(full.outputs, w.max_new))

    # With EOS honoured, a request may end where the host did not foresee it: the pass run ahead
    # then feeds nothing and the right pass runs after it. Tokens are the EOS-free run's, cut at
    # each request's first EOS.
    eos = int(full.outputs[2][1])
    calls.clear()
    cfg.engine.eos_id = eos
    cut = simulate(cfg, w)
    assert sum(calls) > 0 and len(calls) > int((cut.record.kind == DECODE).sum())  # some wasted
    for a, b in zip(cut.outputs, full.outputs):
        hits = np.flatnonzero(b == eos)
        np.testing.assert_array_equal(a, b[: hits[0] + 1] if len(hits) else b)


def test_a_decode_pass_on_a_plan_it_does_not_fit_changes_nothing(spec, params):
    w = make_workload([6, 20], [4, 4])
    runner = Runner(spec, params, 2, w.prompts(spec.vocab_size, spec.max_len), w.prompt_len)
    i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    table = np.zeros((2, 0), np.int32)
    shape = runner.buckets.decode(16)
    past = shape.context  # slot 1's token goes one position past the shape's context
    before = jax.tree.map(np.asarray, (runner.cache, runner.token_buf))
    for plan in (  # a prefill plan; a decode plan reading past the shape's context
        Plan(i32([0, 1]), i32([6, 20]), i32([0, 0]), np.int32(PREFILL), np.float32(0), table),
        Plan(i32([0, 1]), i32([1, 1]), i32([6, past]), np.int32(DECODE), np.float32(0), table),
    ):
        tokens, _ = runner.decode(plan, shape)
        np.testing.assert_array_equal(tokens, [-1, -1])
        after = jax.tree.map(np.asarray, (runner.cache, runner.token_buf))
        assert all((a == b).all() for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))


def test_a_decode_of_few_slots_runs_their_rows_alone_with_the_all_slot_decodes_results(
    spec, params
):
    """A decode feeding 2 of 8 slots runs at 2 rows (`Buckets.decode_width`, the host's shape of
    its plan) and writes the K/V and draws the tokens the decode over every slot does, bit for
    bit; the slots it does not feed draw nothing. A decode of 3 slots does not fit those 2 rows:
    dispatched on them, it feeds nothing and changes nothing."""
    n = 8
    w = make_workload([5, 9, 3, 7, 4, 6, 8, 2], [4] * n)
    runners = [Runner(spec, params, n, w.prompts(spec.vocab_size, spec.max_len), w.prompt_len)
               for _ in range(2)]  # fmt: skip
    table = np.zeros((n, 0), np.int32)

    def plan(kind, req, num_tokens, start):
        return Plan(*(np.asarray(x, np.int32) for x in (req, num_tokens, start)),
                    np.int32(kind), np.float32(0), table)  # fmt: skip

    prefill = plan(PREFILL, np.arange(n), w.prompt_len, np.zeros(n))
    fed = np.isin(np.arange(n), [1, 6])
    decode = plan(DECODE, np.where(fed, np.arange(n), -1), fed, np.where(fed, w.prompt_len, 0))
    compact = runners[0].buckets.shape_of(decode)
    assert (compact.rows, compact.compact, compact.all_slots) == (2, True, False)
    results = []
    for runner, shape in zip(runners, (compact, runners[1].buckets.decode(10))):
        runner.execute(prefill, runner.buckets.shape_of(prefill))
        tokens, _ = runner.execute(decode, shape)
        results.append(jax.tree.map(np.asarray, (tokens, runner.cache, runner.token_buf)))
    assert (results[0][0][~fed] == -1).all() and (results[0][0][fed] >= 0).all()
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]), strict=True):
        np.testing.assert_array_equal(a, b)
    three = fed | (np.arange(n) == 0)
    tokens, _ = runners[0].decode(
        plan(DECODE, np.where(three, np.arange(n), -1), three, np.where(three, 10, 0)), compact
    )
    np.testing.assert_array_equal(tokens, np.full(n, -1))
    after = jax.tree.map(np.asarray, (runners[0].cache, runners[0].token_buf))
    for a, b in zip(jax.tree.leaves(results[0][1:]), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("loop", ["host", "device"])
def test_decode_rows_all_runs_every_decode_at_every_slot_with_the_same_plans(loop):
    """`engine.decode_rows`: compact (the default) runs a decode of at most a quarter of the
    slots at the power of two at or above their count, `all` every decode at every slot; the
    plans are the same (the simulator records the runner's shapes, both loops alike)."""
    w = make_workload([5, 9, 3, 7, 4, 6, 8, 2, 12], [3, 20, 5, 9, 14, 2, 30, 6, 11])
    runs = {}
    for rows in ("compact", "all"):
        cfg = make_config("continuous", num_slots=8, backend="simulator", clock="passes",
                          loop=loop, decode_rows=rows)  # fmt: skip
        runs[rows] = simulate(cfg, w).record
    compact, every = runs["compact"], runs["all"]
    for field in ("kind", "req", "num_tokens", "start_pos"):
        np.testing.assert_array_equal(getattr(compact, field), getattr(every, field))
    decodes = compact.kind == DECODE
    fed = (compact.num_tokens[decodes] > 0).sum(axis=1)
    width = np.where(fed <= 2, 1 << np.ceil(np.log2(fed)).astype(int), 8)  # quarter of 8: 2
    np.testing.assert_array_equal(compact.rows[decodes], width)
    assert (width < 8).any() and (every.rows[decodes] == 8).all()


TIGHT = MemoryConfig(layout="paged", budget_tokens=160, block_size=16, watermark=0.0)


@pytest.mark.parametrize(
    "policy, memory, clock",
    [("static", None, "measured"), ("continuous", None, "measured"), ("orca", None, "measured"),
     ("chunked", None, "measured"), ("continuous", TIGHT, "measured"),
     ("chunked", TIGHT, "measured"), ("continuous", None, "passes"), ("static", None, "passes")],
)  # fmt: skip
def test_planned_warmup_shapes_are_exactly_the_shapes_a_run_executes(policy, memory, clock):
    """A run without EOS, offline on the measured clock or with arrivals (and static's wait for a
    full batch) on the `passes` clock: its dry run (`passes` clock, every token 0) finds the
    very shapes the real run executes (the model's tokens, decodes dispatched ahead), all among
    the shapes the workload can use; under a tight paged budget too, which preempts."""
    cfg = make_config(policy, num_slots=3, clock=clock)
    cfg.policy.token_budget = 64
    cfg.policy.max_wait_s = 3.0 if clock == "passes" else 0.0  # static waits 3 passes
    if memory is not None:
        cfg.memory = memory
    arrival = np.zeros(6) if clock == "measured" else np.array([0, 0, 4, 9, 9, 30])
    w = make_workload([80, 13, 80, 40, 7, 28], [20, 9, 20, 12, 14, 5], arrival)
    pol, params, state, runner, mem, _, _ = _prepare(cfg, w)
    assert fixed_plans(state, params, clock)
    planned = planned_shapes(pol, params, state, runner.buckets, PLANNED_PASSES, w.arrival)
    res = run(pol, params, state, runner, [], clock, arrival=w.arrival)  # shapes at first use
    executed = {kinds[0] for kinds in runner._passes}
    assert len(planned) == len(set(planned)) and set(planned) == executed
    assert executed <= set(runner.buckets.for_workload(w.prompt_len, w.max_new, mem.paged))
    assert (np.asarray(res.final.num_preemptions).sum() > 0) == (memory is not None)


def test_plans_are_fixed_without_eos_offline_or_on_the_passes_clock():
    state = init_state(np.zeros(2), np.array([4, 5]), np.array([3, 3]), np.zeros(2, bool), 2)
    assert fixed_plans(state, PolicyParams())  # offline, EOS ignored, no wait
    assert not fixed_plans(state, PolicyParams(eos_id=np.int32(0)))
    assert not fixed_plans(state, PolicyParams(max_wait_s=np.float32(0.01)))
    lengths = np.array([4, 5]), np.array([3, 3]), np.zeros(2, bool), 2
    late = init_state(np.array([0.0, 0.5]), *lengths)
    assert not fixed_plans(late, PolicyParams())
    assert fixed_plans(late, PolicyParams(max_wait_s=np.float32(0.01)), "passes")
    assert not fixed_plans(late, PolicyParams(eos_id=np.int32(0)), "passes")


def test_a_dry_run_longer_than_its_bound_plans_nothing():
    """planned_shapes gives up (None: warm-up prepares every possible shape) where the outputs
    alone need more than `max_passes` decodes of every slot, or where the dry run passes it."""
    buckets, policy = Simulator(num_slots=2, max_len=256).buckets, make_policy("continuous")
    state = init_state(np.zeros(2), np.array([4, 5]), np.array([1, 5]), np.zeros(2, bool), 2)
    plan = lambda n: planned_shapes(policy, PolicyParams(), state, buckets, n)  # noqa: E731
    assert plan(2) is None  # 6 outputs > 2 passes x 2 slots: not even tried
    assert plan(3) is None  # tried: a prefill and 4 decodes, more than 3 passes
    assert plan(4) is None  # a prefill and 3 of the 4 decodes: 5 passes in all
    # contexts 6..10: one bucket, met by the 4 decodes
    assert plan(5) == {buckets.prefill(2, 5, 5): 1, buckets.decode(6): 4}


def test_a_rare_shape_is_raised_to_the_next_planned_context_bucket_by_both_rules():
    """`Buckets.raise_rare`: a shape met at most `at_most` times runs at the next context bucket
    of the same rows where the counts hold that shape and do not raise it too; a shape reading
    no context stays. The host's and the device's rule (`shape_fields` on numpy and jnp) agree."""
    b = Buckets(16, 1024, 16, mixed_rows=512, min_context=64)
    counts = {
        b.flat(512, 64): 1, b.flat(512, 128): 2,  # 512/128: rare, but no 512/256
        b.flat(256, 128): 1, b.flat(256, 256): 40,
        b.decode(100): 3, b.decode(200): 250,  # met 3 times: more than at_most
        b.decode(100, 2): 1,  # no 2-row decode at 256
        b.prefill(4, 100, 100): 1, b.prefill(4, 100, 200, 90): 1,  # none / 128: no 256 sibling
    }  # fmt: skip
    r = b.raise_rare(counts, 2)
    contexts = [r.runs_at(s).context for s in counts]
    assert contexts == [128, 128, 256, 256, 128, 256, 128, 0, 256]
    table = np.zeros((16, 0), np.int32)
    i32 = lambda x: np.broadcast_to(np.asarray(x, np.int32), (16,)).copy()  # noqa: E731
    plans = {  # (rows, context before, after): a plan of each raised shape, and of one kept
        (512, 64, 128): Plan(i32(np.arange(16)), i32(32), i32(0), np.int32(MIXED),
                             np.float32(0), table),  # every slot's first 32 prompt tokens
        (256, 128, 256): Plan(i32(np.arange(16)), i32([241] + [1] * 15), i32([0] + [100] * 15),
                              np.int32(MIXED), np.float32(0), table),
        (16, 128, 128): Plan(i32(np.arange(16)), i32(1), i32(100), np.int32(DECODE),
                             np.float32(0), table),
    }  # fmt: skip
    for (rows, before, after), plan in plans.items():
        assert (b.shape_of(plan).rows, b.shape_of(plan).context) == (rows, before)
        assert (r.shape_of(plan).rows, r.shape_of(plan).context) == (rows, after)
        device = r.shape_fields(jax.tree.map(jnp.asarray, plan), jnp)
        assert (int(device[0]), int(device[2])) == (rows, after)


@pytest.mark.parametrize("compact", [False, True])
def test_the_shapes_of_many_passes_at_once_equal_each_pass_its_own(compact):
    """`shape_fields` of a record's passes (per-slot fields [P, B], kind [P]) gives, pass by
    pass, what it gives each pass alone: every kind, idle included, with raised buckets; so
    `RunnerStep.needed` finds a record's shapes in one call."""
    rng = np.random.default_rng(0)
    b = Buckets(16, 1024, 16, mixed_rows=512, min_context=64, compact=compact)
    b = b.raise_rare({b.flat(256, 128): 1, b.flat(256, 256): 40, b.decode(100): 1,
                      b.decode(200): 250}, 2)  # fmt: skip
    assert b.raised
    p = 2000
    kind = rng.integers(0, 4, p).astype(np.int32)  # IDLE, PREFILL, DECODE, MIXED
    fed = rng.random((p, 16)) < rng.random((p, 1))  # passes of few slots and of many
    longest, furthest = rng.integers(2, 300, (p, 1)), rng.integers(1, 700, (p, 1))
    num_tokens = np.where(fed, rng.integers(1, longest, (p, 16)), 0)
    num_tokens = np.where((kind == DECODE)[:, None], np.minimum(num_tokens, 1), num_tokens)
    start_pos = np.where(num_tokens > 0, rng.integers(0, furthest, (p, 16)), 0)
    req = np.where(num_tokens > 0, np.arange(16), -1)
    i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    table = np.zeros((0,), np.int32)
    at_once = b.shape_fields(Plan(i32(req), i32(num_tokens), i32(start_pos), kind,
                                  np.float32(0), table))  # fmt: skip
    alone = [b.shape_fields(Plan(i32(req[i]), i32(num_tokens[i]), i32(start_pos[i]), kind[i],
                                 np.float32(0), table)) for i in range(p)]  # fmt: skip
    for field, column in enumerate(at_once):
        np.testing.assert_array_equal(column, [a[field] for a in alone])
    assert len(set(zip(*at_once[:3]))) > 40  # many shapes, not a few


def test_warmup_raises_a_shape_its_dry_run_meets_once_with_the_same_tokens():
    """Planned by a dry run, warm-up prepares one shape fewer: the one decode at context 64 (slot
    0's first, ending at position 64) runs at context 128 with the run's other decodes. The
    tokens are those of a run at every pass's own bucket, nothing compiles after warm-up, and
    the record gives the context each pass ran at."""
    w = make_workload([63, 20], [40, 40])
    runs = {}
    for warmup in (True, False):
        runs[warmup] = simulate(make_config("continuous", num_slots=2, warmup=warmup), w)
    raised, exact = runs[True], runs[False]
    for a, b in zip(raised.outputs, exact.outputs, strict=True):
        np.testing.assert_array_equal(a, b)
    decodes = exact.record.kind == DECODE
    assert list(np.unique(exact.record.context[decodes])) == [64, 128]
    assert (raised.record.context[decodes] == 128).all()
    assert raised.warmup_planned and raised.warmup_shapes == 2  # the prefill, the 128 decode
    assert raised.compiles_after_warmup == 0


def test_planning_again_raises_from_every_pass_at_its_own_bucket():
    """`plan_warmup` plans from the buckets at every pass's own context, so planning a second
    time on the same backend raises the same shapes, never one bucket further."""
    sim = Simulator(num_slots=2, max_len=256, min_context=64)
    state = init_state(np.zeros(2), np.array([63, 20]), np.array([40, 40]), np.zeros(2, bool), 2)
    policy = make_policy("continuous")
    first = plan_warmup(policy, PolicyParams(), state, sim)
    raised = sim.buckets
    assert [(s.all_slots, s.context) for s in first] == [(False, 0), (True, 128)]
    assert plan_warmup(policy, PolicyParams(), state, sim) == first and sim.buckets == raised


def test_a_repeated_plan_reads_its_dry_run_from_the_store(tmp_path, monkeypatch, caplog):
    """A built-in policy's dry run is kept in the compile store under a key of the code and of
    every input (`executables.remembered`): planning the same run again, as a repeated run does
    in a new process, reads the same shapes and raises them alike without running it; another
    workload, or a registered policy (whose code is in no key), runs its own; a file that cannot
    be read is computed again."""
    monkeypatch.setattr(compilation, "_store", [tmp_path])
    runs = []
    monkeypatch.setattr(engine, "planned_shapes", lambda *a: runs.append(a) or planned_shapes(*a))
    state = init_state(np.zeros(2), np.array([63, 20]), np.array([40, 40]), np.zeros(2, bool), 2)
    other = state.replace(prompt_len=state.prompt_len.at[1].set(21))

    def plan(policy, state):
        sim = Simulator(num_slots=2, max_len=256, min_context=64)
        return plan_warmup(policy, PolicyParams(), state, sim), sim.buckets

    continuous = make_policy("continuous")
    first = plan(continuous, state)
    assert len(runs) == 1 and len(list(tmp_path.glob("*.val"))) == 1
    assert plan(continuous, state) == first and len(runs) == 1  # read, not run
    assert [(s.all_slots, s.context) for s in first[0]] == [(False, 0), (True, 128)]
    plan(continuous, other)
    assert len(runs) == 2 and len(list(tmp_path.glob("*.val"))) == 2
    own = continuous._replace(schedule=lambda *a: continuous.schedule(*a))
    assert plan(own, state) == first and len(runs) == 3
    assert plan(own, state) == first and len(runs) == 4  # never stored
    for path in tmp_path.glob("*.val"):
        path.write_bytes(b"cut")
    assert plan(continuous, state) == first and len(runs) == 5
    assert "computing it again" in caplog.text
    assert plan(continuous, state) == first and len(runs) == 5
