"""A request's logits and tokens do not depend on which requests share its passes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxbatch.run import simulate
from jaxbatch.sched.state import DECODE
from tests.conftest import TEST_MODEL, make_config, make_workload

PROMPTS = [5, 30, 12, 60, 9, 33]
BUDGETS = [10, 3, 17, 6, 12, 8]


def per_request_logits(result, num_requests):
    """The logits that produced each output token, in order, per request."""
    return {i: x for i, x in result.request_logits().items() if i < num_requests}


@pytest.fixture(scope="module")
def alone():
    """Each request run by itself on one slot."""
    logits, tokens = {}, {}
    for i in range(len(PROMPTS)):
        res = _run("continuous", make_workload(PROMPTS, BUDGETS).subset([i]), num_slots=1)
        logits[i] = per_request_logits(res, 1)[0]
        tokens[i] = res.outputs[0]
    return logits, tokens


def _run(policy, workload, num_slots, model=None, **engine):
    cfg = make_config(policy, num_slots=num_slots, clock="passes", **engine)
    cfg.model = model or cfg.model
    return simulate(cfg, workload, with_logits=True)


@pytest.mark.parametrize("policy", ["static", "continuous"])
def test_logits_alone_equal_logits_shared(alone, policy):
    logits_alone, tokens_alone = alone
    res = _run(policy, make_workload(PROMPTS, BUDGETS), num_slots=4, decode_rows="compact")
    decodes = res.record.kind == DECODE
    assert (res.record.rows[decodes] == 1).any()  # decodes of one slot ran at one row
    shared = per_request_logits(res, len(PROMPTS))
    for i in range(len(PROMPTS)):
        assert shared[i].shape == logits_alone[i].shape == (BUDGETS[i], 256)
        np.testing.assert_allclose(shared[i], logits_alone[i], atol=1e-4)
        np.testing.assert_array_equal(res.outputs[i], tokens_alone[i])


@pytest.mark.parametrize("kv_dtype", ["auto", "bfloat16"])
def test_greedy_and_sampled_tokens_equal_under_both_policies(kv_dtype):
    model = dataclasses.replace(TEST_MODEL, kv_dtype=kv_dtype)
    w = make_workload([7, 40, 20, 3, 15], [9, 4, 12, 6, 5], arrival=[0, 0, 2, 3, 3])
    outputs = []
    for engine in ({}, {"temperature": 0.8, "top_k": 20, "seed": 3}):
        s = _run("static", w, num_slots=2, model=model, **engine).outputs
        c = _run("continuous", w, num_slots=2, model=model, **engine).outputs
        one = _run("continuous", w.subset([3]), num_slots=1, model=model, **engine).outputs
        for a, b, m in zip(s, c, w.max_new):
            assert len(a) == m
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(one[0], c[3])
        outputs.append(c)
    greedy, sampled = outputs
    assert any((a != b).any() for a, b in zip(greedy, sampled)), "sampling must change some tokens"


def test_a_bfloat16_kv_cache_keeps_tokens_independent_of_the_slot_count():
    """float32 compute over a bfloat16 cache: half the KV bytes, and a request's greedy tokens are
    the same alone and sharing 4 slots (bfloat16 compute is not: see README, Batch invariance)."""
    model = dataclasses.replace(TEST_MODEL, kv_dtype="bfloat16")
    assert model.spec().kv_bytes_per_token * 2 == TEST_MODEL.spec().kv_bytes_per_token
    w = make_workload(PROMPTS, BUDGETS)
    shared = _run("continuous", w, num_slots=4, model=model)
    f32 = _run("continuous", w, num_slots=4)
    for i in range(len(PROMPTS)):
        alone = _run("continuous", w.subset([i]), num_slots=1, model=model)
        np.testing.assert_array_equal(shared.outputs[i], alone.outputs[0])
    # The rounded cache moves logits by about bfloat16's step, never more than 1e-2 here.
    a, b = per_request_logits(shared, len(PROMPTS)), per_request_logits(f32, len(PROMPTS))
    gap = max(float(np.abs(a[i] - b[i]).max()) for i in a)
    assert 0 < gap < 1e-2
