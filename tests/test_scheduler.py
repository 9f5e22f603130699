"""Scheduler invariants on random workloads (hypothesis), run through the engine with the
simulator and the deterministic `passes` clock."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxbatch.backend.simulator import Simulator
from jaxbatch.engine import run
from jaxbatch.inplace import set_few
from jaxbatch.sched.blocks import MemorySpec
from jaxbatch.sched.policies import PolicyParams, _smallest, admit, make_policy, queue_key, release
from jaxbatch.sched.state import FINISHED, PREEMPTED, PREFILL, RUNNING, WAITING, init_state

N = 12  # fixed, so the jitted policies compile once per slot count


@st.composite
def workloads(draw, offline=False):
    prompt = draw(st.lists(st.integers(1, 40), min_size=N, max_size=N))
    budget = draw(st.lists(st.integers(1, 30), min_size=N, max_size=N))
    if offline:
        arrival = [0.0] * N
    else:
        arrival = sorted(draw(st.lists(st.integers(0, 60), min_size=N, max_size=N)))
    slots = draw(st.sampled_from([1, 3, 4]))
    return np.array(arrival, float), np.array(prompt), np.array(budget), slots


def simulate(policy, arrival, prompt, budget, slots, max_wait=0.0):
    state = init_state(arrival, prompt, budget, np.zeros(N, bool), slots)
    params = PolicyParams(max_wait_s=np.float32(max_wait))
    return run(make_policy(policy), params, state, Simulator(slots, 128), [], clock="passes")


def admission_pass(rec):
    """[N] the first pass in which each request holds a slot."""
    first = np.full(N, -1)
    for p in range(rec.num_passes - 1, -1, -1):
        held = rec.holder[p][rec.holder[p] >= 0]
        first[held] = p
    return first


def check_common(res, arrival, prompt, budget):
    rec = res.record
    # Every request ends finished, with exactly its budget of output tokens.
    assert (np.asarray(res.final.status) == FINISHED).all()
    np.testing.assert_array_equal(np.bincount(rec.req[rec.emits], minlength=N), budget)
    # No slot holds two requests, no request holds two slots.
    for holders in rec.holder:
        held = holders[holders >= 0]
        assert len(held) == len(set(held.tolist()))
    # A fed slot holds the request it feeds; nothing runs before it arrives.
    fed = rec.num_tokens > 0
    np.testing.assert_array_equal(rec.req[fed], rec.holder[fed])
    p_idx, _ = np.nonzero(fed)
    assert (rec.start[p_idx] >= arrival[rec.req[fed]]).all()
    # Each prompt is fed exactly once, and every other output token costs one decode slot-pass.
    prefill = fed & (rec.kind == PREFILL)[:, None]
    np.testing.assert_array_equal(np.bincount(rec.req[prefill], minlength=N), np.ones(N))
    assert rec.num_tokens[prefill].sum() == prompt.sum()
    assert (fed & ~prefill).sum() == (budget - 1).sum()
    # The passes clock: each pass starts one unit after the last, or at an arrival.
    assert (np.diff(rec.start) >= 1).all()
    # The KV positions live after each pass: every holder's tokens fed so far (no preemption).
    cached, live = np.zeros(N, int), []
    for p in range(rec.num_passes):
        np.add.at(cached, rec.req[p][fed[p]], rec.num_tokens[p][fed[p]])
        live.append(cached[rec.holder[p][rec.holder[p] >= 0]].sum())
    np.testing.assert_array_equal(rec.kv_tokens, live)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_continuous_invariants(w):
    arrival, prompt, budget, slots = w
    res = simulate("continuous", *w)
    check_common(res, arrival, prompt, budget)
    # Admission follows arrival order (ties by id): FCFS.
    first = admission_pass(res.record)
    fcfs = np.lexsort((np.arange(N), arrival))
    assert (np.diff(first[fcfs]) >= 0).all()
    # Work-conserving: no slot is left free while an arrived request waits.
    rec = res.record
    for p in range(rec.num_passes):
        waiting = (arrival <= rec.start[p]) & (first > p)
        if waiting.any():
            assert (rec.holder[p] >= 0).all()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_static_invariants(w):
    arrival, prompt, budget, slots = w
    res = simulate("static", *w)
    check_common(res, arrival, prompt, budget)
    rec = res.record
    first = admission_pass(rec)
    # A batch is admitted only into empty slots: a pass's holders are either the same set as the
    # pass before, or a set with none of its requests.
    for p in range(1, rec.num_passes):
        now, before = (
            set(rec.holder[p][rec.holder[p] >= 0]),
            set(rec.holder[p - 1][rec.holder[p - 1] >= 0]),
        )
        assert now == before or not (now & before), (p, now, before)
    # Each batch runs for exactly as many passes as its longest output budget (prefill included).
    batches = {}
    for r in range(N):
        batches.setdefault(first[r], []).append(r)
    for start, members in batches.items():
        assert first[members].min() == start
        length = budget[members].max()
        assert all((rec.holder[start + length - 1] == m).any() for m in members)
        if start + length < rec.num_passes:
            assert not any((rec.holder[start + length] == m).any() for m in members)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(offline=True))
def test_offline_pass_counts(w):
    arrival, prompt, budget, slots = w
    # Static: FCFS batches of `slots` requests, each costing its longest budget in passes.
    static = simulate("static", *w)
    batches = [budget[i : i + slots] for i in range(0, N, slots)]
    assert static.record.num_passes == sum(b.max() for b in batches)
    # Continuous: its prefill passes decode nothing, so it needs them plus the decode work spread
    # over the slots. (It can need more passes than static: see the test below.)
    cont = simulate("continuous", *w)
    prefills = (cont.record.kind == PREFILL).sum()
    assert cont.record.num_passes >= prefills + np.ceil((budget - 1).sum() / slots)


def test_prefill_first_stalls_decodes():
    """Found by hypothesis: twelve 1-token prompts, budgets 1 but request 8's 2, three slots.
    Static needs 1+1+2+1 = 5 passes. Continuous needs 6: request 8's one decode waits behind the
    prefill passes of 9+10 and then of 11, which take the slots freed around it."""
    arrival, prompt = np.zeros(N), np.ones(N, int)
    budget = np.ones(N, int)
    budget[8] = 2
    static = simulate("static", arrival, prompt, budget, 3).record
    cont = simulate("continuous", arrival, prompt, budget, 3).record
    assert static.num_passes == 5
    assert cont.num_passes == 6
    decode_of_8 = np.flatnonzero((cont.req == 8).any(1) & (cont.kind != PREFILL))
    np.testing.assert_array_equal(decode_of_8, [5])


def test_static_waits_for_a_full_batch_up_to_max_wait():
    arrival = np.array([0, 1, 2, 3, 50, 51, 52, 53, 54, 55, 56, 57], float)
    prompt, budget = np.full(N, 4), np.full(N, 2)
    first_wait = admission_pass(simulate("static", arrival, prompt, budget, 4, 10.0).record)
    first_now = admission_pass(simulate("static", arrival, prompt, budget, 4, 0.0).record)
    rec = simulate("static", arrival, prompt, budget, 4, 10.0).record
    # With max_wait 10 the first four arrive by t=3 and fill the batch: it starts at t=3.
    assert rec.start[first_wait[0]] == 3.0
    assert (first_wait[:4] == first_wait[0]).all()
    # With no wait, request 0 starts alone at t=0.
    assert first_now[0] == 0 and first_now[1] > 0
    # Requests 4..7 arrive at 50..53 and fill a batch at t=53; 8..11 have 55..57 and no more
    # arrivals, so with max_wait 10 they run when the last one arrives, at t=57.
    assert rec.start[first_wait[4]] == 53.0
    assert rec.start[first_wait[8]] == 57.0


def test_schedule_is_jittable_and_vmappable():
    """Two workloads scheduled in one vmapped call give the same plans as two separate calls."""
    policy = make_policy("continuous")
    s1 = init_state(np.zeros(N), np.arange(1, N + 1), np.ones(N, int), np.zeros(N, bool), 4)
    s2 = init_state(np.arange(N, dtype=float), np.full(N, 5), np.ones(N, int), np.zeros(N, bool), 4)
    params = PolicyParams()
    both = jax.tree.map(lambda a, b: jnp.stack([a, b]), s1, s2)
    _, plans = jax.jit(jax.vmap(policy.schedule, in_axes=(0, None)))(both, params)
    for i, s in enumerate((s1, s2)):
        _, plan = jax.jit(policy.schedule)(s, params)
        np.testing.assert_array_equal(plans.req[i], plan.req)
        np.testing.assert_array_equal(plans.num_tokens[i], plan.num_tokens)
    np.testing.assert_array_equal(plans.req[0], [0, 1, 2, 3])
    np.testing.assert_array_equal(plans.num_tokens[0], [1, 2, 3, 4])
    np.testing.assert_array_equal(plans.req[1], [0, -1, -1, -1])


def test_eos_ends_a_request_when_honoured():
    # The simulator draws token 0 everywhere: with eos_id 0 each request ends at its first token.
    arrival, prompt, budget = np.zeros(N), np.full(N, 5), np.full(N, 9)
    for eos, expect in ((-1, 9), (0, 1), (7, 9)):
        state = init_state(arrival, prompt, budget, np.zeros(N, bool), 4)
        params = PolicyParams(eos_id=np.int32(eos))
        res = run(make_policy("continuous"), params, state, Simulator(4, 128), [], clock="passes")
        assert (np.asarray(res.final.status) == FINISHED).all()
        np.testing.assert_array_equal(np.asarray(res.final.num_generated), np.full(N, expect))


def _admission_order(policy, prompt, budget, arrival, priority, queue, slots=2):
    state = init_state(arrival, prompt, budget, np.zeros(N, bool), slots, priority)
    sim = Simulator(slots, 128)
    res = run(make_policy(policy, queue), PolicyParams(), state, sim, [], clock="passes")
    assert (np.asarray(res.final.status) == FINISHED).all()
    return admission_pass(res.record)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(offline=True), st.lists(st.integers(0, 3), min_size=N, max_size=N))
def test_queue_orders_admit_by_their_key(w, priority):
    arrival, prompt, budget, slots = w
    priority = np.array(priority)
    ids = np.arange(N)
    for policy in ("static", "continuous"):
        spf = _admission_order(policy, prompt, budget, arrival, priority, "spf", slots)
        by_prompt = np.lexsort((ids, prompt))
        assert (np.diff(spf[by_prompt]) >= 0).all()
        prio = _admission_order(policy, prompt, budget, arrival, priority, "priority", slots)
        by_priority = np.lexsort((ids, -priority))
        assert (np.diff(prio[by_priority]) >= 0).all()


def test_shortest_prompt_first_starves_a_long_prompt_that_fcfs_serves():
    """One slot. A 30-token prompt arrives at t=0 behind a running request; 4-token prompts keep
    arriving every pass. FCFS serves the long prompt second; SPF serves it only once the short
    ones stop arriving."""
    arrival = np.array([0, 0.5] + [1.0 + 2 * i for i in range(N - 2)])
    prompt = np.array([4, 30] + [4] * (N - 2))
    budget = np.full(N, 2)
    priority = np.zeros(N, int)
    fcfs = _admission_order("continuous", prompt, budget, arrival, priority, "fcfs", slots=1)
    spf = _admission_order("continuous", prompt, budget, arrival, priority, "spf", slots=1)
    assert np.argsort(fcfs, kind="stable")[1] == 1  # admitted second
    assert spf[1] == spf.max()  # admitted last, after every short prompt


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 40), st.integers(1, 6), st.sampled_from(["fcfs", "spf", "priority"]),
    st.randoms(use_true_random=False),
)  # fmt: skip
def test_the_queue_keys_smallest_are_the_first_slots_of_a_three_key_sort(n, slots, queue, rnd):
    """The queue's static rank plus a top-k equals sorting (queued first, preempted at the head;
    then the queue's key, arrival, id), the rule it replaced, ties in arrival and key included."""
    rng = np.random.default_rng(rnd.randrange(2**32))
    arrival = rng.integers(0, 4, n).astype(float)  # many ties
    prompt, priority = rng.integers(1, 4, n), rng.integers(0, 3, n)
    state = init_state(arrival, prompt, np.ones(n, int), np.zeros(n, bool), slots,
                       priority=priority)  # fmt: skip
    status = rng.choice([WAITING, RUNNING, PREEMPTED, FINISHED], n)
    state = state.replace(status=jnp.asarray(status, jnp.int32), now=jnp.float32(2.0))
    key = {"fcfs": np.zeros(n), "spf": prompt, "priority": -priority}[queue]

    def order(now):
        queued = ((status == WAITING) | (status == PREEMPTED)) & (arrival <= now)
        head = np.where(queued, np.where(status == PREEMPTED, 0, 1), 2)
        return np.lexsort((np.arange(n), arrival, key, head))[:slots]

    want = order(2.0)
    got = np.asarray(jax.jit(lambda s: _smallest(queue_key(s, queue), slots))(state))
    np.testing.assert_array_equal(got[: min(n, slots)], want)
    assert (got[n:] == 0).all()


@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 30), st.sampled_from([1, 3, 6, 12]),
    st.sampled_from(["fcfs", "spf", "priority"]), st.sampled_from(["none", "max_len", "exact"]),
    st.randoms(use_true_random=False),
)  # fmt: skip
def test_a_vmapped_admission_at_every_width_equals_each_member_admitted_alone(
    n, slots, queue, memory, rnd
):
    """A sweep's members admit at one width, the batch's (`policies._admission`: 0, 1, 2, 8 or
    every slot, by the largest count any member admits): each member's state equals its own
    admission alone, field for field, whatever the widest member, each member with its own
    clock, free slots, queue and memory left."""
    rng = np.random.default_rng(rnd.randrange(2**32))
    m = 6
    budget_tokens = int(rng.integers(8, 200))
    mem = None if memory == "none" else MemorySpec(budget_tokens, 64, "contiguous", memory)
    prompt, budget = rng.integers(1, 30, n), rng.integers(1, 30, n)
    state = init_state(rng.integers(0, 4, n).astype(float), prompt, budget, np.zeros(n, bool),
                       slots, priority=rng.integers(0, 3, n), memory=mem)  # fmt: skip
    members = []
    for r in range(m):
        status = rng.choice([WAITING, PREEMPTED, FINISHED, RUNNING], n, p=[0.5, 0.2, 0.1, 0.2])
        holders = np.flatnonzero(status == RUNNING)[:slots]
        status[(status == RUNNING)] = FINISHED
        status[holders] = RUNNING
        slot_req = np.full(slots, -1)
        slot_req[rng.permutation(slots)[: len(holders)]] = holders
        members.append(state.replace(
            status=jnp.asarray(status, jnp.int32), slot_req=jnp.asarray(slot_req, jnp.int32),
            num_generated=jnp.asarray(rng.integers(0, 3, n), jnp.int32),
            reserved=jnp.asarray(np.where(status == RUNNING, 4, 0), jnp.int32),
            now=jnp.float32(r % 4), step=jnp.int32(r),
        ))  # fmt: skip
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *members)
    params = PolicyParams()
    alone = jax.jit(admit, static_argnums=3)
    batched = jax.jit(jax.vmap(admit, (0, 0, None, None)), static_argnums=3)
    for top in sorted({0, 1, 2, 3, 8, 9, slots}):  # the widest member: every width in turn
        limits = np.minimum(rng.integers(0, slots + 1, m), top)
        limits[0] = top
        got = batched(stacked, jnp.asarray(limits, jnp.int32), params, queue)
        for r in range(m):
            want = alone(members[r], jnp.int32(limits[r]), params, queue)
            for field in ("slot_req", "slot", "status", "admit_order", "reserved"):
                np.testing.assert_array_equal(getattr(got, field)[r], getattr(want, field))


def test_release_frees_only_the_masked_slots_requests():
    """An unmasked slot's request index once was -1, which JAX's scatter wraps to the last
    request: every release cleared request N-1's slot and reservation while it ran."""
    mem = MemorySpec(200, 64, "contiguous", "exact")
    state = init_state(np.zeros(3), [40, 40, 10], [10, 10, 50], np.zeros(3, bool), 2, memory=mem)
    state = state.replace(
        slot_req=jnp.array([2, 0], jnp.int32), slot=jnp.array([1, -1, 0], jnp.int32),
        status=jnp.array([RUNNING, WAITING, RUNNING], jnp.int32),
        reserved=jnp.array([50, 0, 60], jnp.int32),
    )  # fmt: skip
    for mask, slot, reserved in (([False, True], [-1, -1, 0], [0, 0, 60]),
                                 ([False, False], [1, -1, 0], [50, 0, 60]),
                                 ([True, True], [-1, -1, -1], [0, 0, 0])):  # fmt: skip
        out = jax.jit(release)(state, jnp.array(mask))
        np.testing.assert_array_equal(np.asarray(out.slot), slot)
        np.testing.assert_array_equal(np.asarray(out.reserved), reserved)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 12), st.randoms(use_true_random=False))
def test_a_vmapped_set_few_equals_each_members_scatter(most, rnd):
    """`set_few` sets each member's indices alone where none sets more than one, and all of
    them otherwise: the same arrays as a plain scatter per member, whatever the widest member
    (members that set no index, one or `most`; out-of-range indices dropped)."""
    rng = np.random.default_rng(rnd.randrange(2**32))
    n, b, m = 20, 12, 6
    index = np.full((m, b), n)
    for r in range(m):
        k = [0, 1, most][r % 3]
        index[r, rng.permutation(b)[:k]] = rng.choice(n, k, replace=False)
    index[rng.random((m, b)) < 0.2] = n + 3  # beyond N too
    arrays = tuple(rng.integers(0, 9, (m, n)).astype(t) for t in (np.int32, np.int8))
    got = jax.jit(jax.vmap(lambda a, i: set_few(a, i, (-1, 3))))(arrays, index)
    for r in range(m):
        want = (arrays[0][r].copy(), arrays[1][r].copy())
        ok = index[r][index[r] < n]
        want[0][ok], want[1][ok] = -1, 3
        np.testing.assert_array_equal(got[0][r], want[0])
        np.testing.assert_array_equal(got[1][r], want[1])


@pytest.mark.parametrize("policy", ["static", "continuous", "orca", "chunked"])
def test_the_last_request_keeps_its_reservation_while_it_runs(policy):
    """Shortest prompt first admits request N-1 first; its exact reservation (60 of 100
    positions) must keep the others (50 each) out until it ends: at every pass the reserved
    positions are the held requests' needs, within the budget."""
    prompt, budget = np.array([40, 40, 10]), np.array([10, 10, 50])
    mem = MemorySpec(100, 64, "contiguous", "exact")
    state = init_state(np.zeros(3), prompt, budget, np.zeros(3, bool), 2, memory=mem)
    res = run(make_policy(policy, "spf"), PolicyParams(), state, Simulator(2, 128), [],
              clock="passes")  # fmt: skip
    holder = res.record.holder
    held = np.where(holder >= 0, (prompt + budget)[np.maximum(holder, 0)], 0).sum(axis=1)
    np.testing.assert_array_equal(res.record.kv_reserved, held)
    assert held.max() <= 100
    assert (np.asarray(res.final.status) == FINISHED).all()
