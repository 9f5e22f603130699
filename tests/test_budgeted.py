"""Token-budget policies: orca (whole prompts) and chunked (Sarathi-Serve chunked prefill)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxbatch.backend.simulator import Simulator
from jaxbatch.engine import run
from jaxbatch.run import simulate as run_config
from jaxbatch.sched.policies import PolicyParams, make_policy
from jaxbatch.sched.state import FINISHED, init_state
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


def test_a_policy_that_strands_requests_fails_loudly():
    # Orca called directly with a prompt over its budget: it never runs, nor (FCFS) does the
    # request queued behind it.
    state = init_state(np.zeros(2), np.array([100, 5]), np.full(2, 3), np.zeros(2, bool), 2)
    sim = Simulator(2, 1024)
    policy, params = make_policy("orca"), PolicyParams(token_budget=np.int32(64))
    with pytest.raises(RuntimeError, match=r"orca: the run ended with 2 requests neither"):
        run(policy, params, state, sim, [], clock="passes")
