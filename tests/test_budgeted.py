"""Token-budget policies: orca (whole prompts) and chunked (Sarathi-Serve chunked prefill)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxbatch.backend.simulator import Simulator
from jaxbatch.config import MemoryConfig
from jaxbatch.engine import run
from jaxbatch.run import simulate as run_config
from jaxbatch.sched.policies import PolicyParams, make_policy
from jaxbatch.sched.state import FINISHED, REJECTED, init_state
from tests.conftest import make_config, make_workload
from tests.test_scheduler import N, admission_pass, workloads


def _sim(policy, arrival, prompt, budget, slots, **knobs):
    state = init_state(arrival, prompt, budget, np.zeros(len(prompt), bool), slots)
    sim = Simulator(slots, 1024)
    params = PolicyParams(**{k: np.int32(v) for k, v in knobs.items()})
    return run(make_policy(policy), params, state, sim, [], clock="passes")


def test_vllm_chunked_prefill_scenario():
    """Token budget 1024, long-prefill threshold 400, three 800-token prompts."""
    res = _sim("chunked", np.zeros(3), np.full(3, 800), np.full(3, 4), 3,
               token_budget=1024, threshold=400)  # fmt: skip
    np.testing.assert_array_equal(
        res.record.num_tokens[:3], [[400, 400, 224], [400, 400, 224], [1, 1, 352]]
    )


def test_orca_takes_whole_prompts_in_order_under_the_budget():
    # Budget 64: the 30-token prompt and the 20-token one fit (50); the 40-token one waits.
    res = _sim("orca", np.zeros(3), np.array([30, 20, 40]), np.full(3, 3), 3, token_budget=64)
    np.testing.assert_array_equal(res.record.num_tokens[0], [30, 20, 0])
    # Next pass: two decodes and the 40-token prompt (42 <= 64).
    np.testing.assert_array_equal(res.record.num_tokens[1], [1, 1, 40])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.sampled_from([8, 24, 64]), st.sampled_from([0, 5]), st.sampled_from([0, 1]))
def test_budget_invariants(w, token_budget, threshold, max_prefills):
    arrival, prompt, budget, slots = w
    token_budget = max(token_budget, slots)
    for policy in ("chunked", "orca"):
        if policy == "orca" and prompt.max() + slots > token_budget:
            continue  # a prompt that never fits beside the decodes would wait forever
        res = _sim(policy, arrival, prompt, budget, slots, token_budget=token_budget,
                   threshold=threshold, max_prefills=max_prefills)  # fmt: skip
        rec = res.record
        # Every request finishes (no starvation under FCFS) with its whole output budget.
        assert (np.asarray(res.final.status) == FINISHED).all()
        np.testing.assert_array_equal(np.bincount(rec.req[rec.emits], minlength=N), budget)
        # No pass exceeds the budget; admission keeps arrival order.
        assert rec.num_tokens.sum(axis=1).max() <= token_budget
        first = admission_pass(rec)
        assert (np.diff(first[np.lexsort((np.arange(N), arrival))]) >= 0).all()
        # Every request whose prompt is cached and that has not finished decodes in every pass.
        cached = np.zeros(N, int)
        emitted = np.zeros(N, int)
        for p in range(rec.num_passes):
            for b in range(slots):
                r = rec.holder[p, b]
                if r >= 0 and cached[r] >= prompt[r] and emitted[r] < budget[r]:
                    assert rec.num_tokens[p, b] == 1, (policy, p, b)
            fed = rec.num_tokens[p] > 0
            np.add.at(cached, rec.req[p][fed], rec.num_tokens[p][fed])
            np.add.at(emitted, rec.req[p][rec.emits[p]], 1)


def test_chunked_and_orca_tokens_equal_continuous():
    w = make_workload([30, 7, 45, 12], [6, 9, 4, 7], arrival=[0, 0, 1, 2])
    outs = {}
    for policy in ("continuous", "orca", "chunked"):
        cfg = make_config(policy, num_slots=3, clock="passes")
        cfg.policy.token_budget = 64
        cfg.policy.long_prefill_threshold = 16
        res = run_config(cfg, w)
        assert (np.asarray(res.final.status) == FINISHED).all()
        outs[policy] = res.outputs
    for policy in ("orca", "chunked"):
        for a, b in zip(outs[policy], outs["continuous"]):
            np.testing.assert_array_equal(a, b)


def test_orca_rejects_a_prompt_over_its_budget_and_serves_the_rest():
    w = make_workload([30, 100, 20], [4, 4, 4])
    cfg = make_config("orca", num_slots=2, clock="passes", backend="simulator")
    cfg.policy.token_budget = 64
    res = run_config(cfg, w)
    np.testing.assert_array_equal(np.asarray(res.final.status), [FINISHED, 4, FINISHED])


@pytest.mark.parametrize("backend", ["simulator", "runner"])
def test_orca_feeds_a_recomputation_longer_than_its_budget_in_pieces(backend):
    """Orca feeds whole prompts, but a preempted request recomputes its prompt and its outputs,
    which can outgrow the budget: here request 6 (a 46-token prompt of the lowest priority) is
    preempted twice, the second time at position 69, under a budget of 64. It takes what the
    budget leaves and the rest in the passes after; fed whole it waited forever and the run
    never ended. Every request ends with its whole output budget, no pass exceeds the
    budget, and both loops make the same passes; on the runner, with the tokens of a run with
    memory for all (recomputed in pieces, request 6 goes on as if never preempted)."""
    w = make_workload(
        [62, 75, 35, 117, 7, 34, 46, 68, 49, 16, 6],
        [1, 2, 6, 39, 8, 26, 30, 10, 12, 17, 11],
        arrival=[0.0, 0.0, 0.0, 0.0, 0.166, 0.876, 1.138, 2.864, 4.027, 4.244, 4.364],
    )
    w = dataclasses.replace(w, priority=np.array([2, 0, 2, 0, 0, 0, 0, 0, 2, 1, 1]))
    runs = []
    for loop in ("host", "device"):
        # warmed up, the runner's host loop runs its rare shapes one context bucket up, as its
        # device loop does (see the README's Compilation)
        cfg = make_config("orca", num_slots=6, backend=backend, clock="passes", loop=loop,
                          warmup=backend == "runner")  # fmt: skip
        cfg.policy.token_budget = 64
        cfg.memory = MemoryConfig(layout="paged", budget_tokens=160, block_size=16, watermark=0.0)
        runs.append(run_config(cfg, w))
    host, device = runs
    rec, final = host.record, host.final
    served = np.asarray(final.status) != REJECTED  # prompts over 64 (1, 3, 7): rejected up front
    assert (np.asarray(final.status)[served] == FINISHED).all() and served.sum() == 8
    np.testing.assert_array_equal(np.bincount(rec.req[rec.emits], minlength=11)[served],
                                  np.array(w.max_new)[served])  # fmt: skip
    assert rec.num_tokens.sum(axis=1).max() <= 64
    assert int(final.num_preemptions[6]) == 2
    # its prompt (46), its first recomputation whole (49), its second in pieces: 63 tokens beside
    # one decode, short of the 69 it held
    starts = (rec.req == 6) & (rec.start_pos == 0) & (rec.num_tokens > 1)
    assert sorted(rec.num_tokens[starts].tolist()) == [46, 49, 63]
    for field in ("kind", "req", "num_tokens", "start_pos", "holder", "emits", "rows", "context"):
        np.testing.assert_array_equal(getattr(device.record, field), getattr(rec, field))
    if backend == "runner":
        ample = run_config(make_config("orca", num_slots=6, clock="passes"), w)
        assert int(np.asarray(ample.final.num_preemptions).sum()) == 0
        for i in np.flatnonzero(served):
            np.testing.assert_array_equal(host.outputs[i], ample.outputs[i])
            np.testing.assert_array_equal(device.outputs[i], ample.outputs[i])


def test_a_policy_that_strands_requests_fails_loudly():
    # Orca called directly with a prompt over its budget: it never runs, nor (FCFS) does the
    # request queued behind it.
    state = init_state(np.zeros(2), np.array([100, 5]), np.full(2, 3), np.zeros(2, bool), 2)
    sim = Simulator(2, 1024)
    policy, params = make_policy("orca"), PolicyParams(token_budget=np.int32(64))
    with pytest.raises(RuntimeError, match=r"orca: the run ended with 2 requests neither"):
        run(policy, params, state, sim, [], clock="passes")
