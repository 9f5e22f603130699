"""Paged KV: same logits as the slot layout, block invariants, preemption with recompute,
reservation strategies and memory-budget errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxbatch.config import ConfigError, MemoryConfig
from jaxbatch.report.recorder import emitted
from jaxbatch.run import simulate
from jaxbatch.sched.blocks import MemorySpec, blocks_for
from jaxbatch.sched.policies import PolicyParams, make_policy
from jaxbatch.sched.state import FINISHED, RUNNING, init_state
from tests.conftest import make_config, make_workload
from tests.test_batch_invariance import per_request_logits

PROMPTS = [13, 20, 40, 7]
BUDGETS = [9, 5, 12, 14]


def _run(memory: MemoryConfig, prompts=PROMPTS, budgets=BUDGETS, num_slots=3, **engine):
    cfg = make_config("continuous", num_slots=num_slots, clock="passes", **engine)
    cfg.memory = memory
    return simulate(cfg, make_workload(prompts, budgets), with_logits=True)


@pytest.fixture(scope="module")
def slot_layout():
    res = _run(MemoryConfig())
    return per_request_logits(res, len(PROMPTS)), res.outputs


@pytest.mark.parametrize("block_size", [1, 16, 8])  # 8 and 16 divide none of 13, 20, 7
def test_paged_logits_equal_slot_logits(slot_layout, block_size):
    logits, outputs = slot_layout
    res = _run(MemoryConfig(layout="paged", budget_tokens=1024, block_size=block_size))
    paged = per_request_logits(res, len(PROMPTS))
    for i in range(len(PROMPTS)):
        np.testing.assert_allclose(paged[i], logits[i], atol=1e-4)
        np.testing.assert_array_equal(res.outputs[i], outputs[i])


def test_preemption_recomputes_and_loses_nothing():
    """10 usable blocks of 16 positions, two 80-token prompts (5 blocks each): when the first
    needs a sixth block, the second, admitted last, is preempted; both finish with the tokens of
    an ample-memory run, and there is exactly one preemption."""
    prompts, budgets = [80, 80], [20, 20]
    tight = MemoryConfig(layout="paged", budget_tokens=160, block_size=16, watermark=0.0)
    ample = _run(MemoryConfig(), prompts, budgets, num_slots=2)
    res = _run(tight, prompts, budgets, num_slots=2)
    np.testing.assert_array_equal(np.asarray(res.final.num_preemptions), [0, 1])
    assert (np.asarray(res.final.status) == FINISHED).all()
    for a, b in zip(res.outputs, ample.outputs):
        np.testing.assert_array_equal(a, b)
    rec = res.record
    # Pass 0 prefills both; pass 1 is the first decode at position 80, needing a sixth block.
    assert rec.holder[1].tolist() == [0, -1]
    assert rec.kv_reserved.max() <= 160
    # Request 1 is recomputed later: its prompt and the one token it had generated.
    recompute = [p for p in range(2, rec.num_passes) if rec.req[p].tolist().count(1)]
    assert rec.num_tokens[recompute[0]][rec.req[recompute[0]] == 1].tolist() == [81]


@pytest.mark.parametrize("loop", ["host", "device"])
def test_a_chunked_recomputation_emits_only_past_what_it_had_reached(loop):
    """Chunked prefill (chunks of 16) under a tight paged budget: request 2 (a 25-token prompt)
    is preempted after it has generated, and recomputes its prompt and outputs in chunks; a
    pass that ends past its prompt but within what it had reached re-feeds known tokens and
    emits nothing (`policies.commit`). The record's emits (`recorder.emitted`) equal each
    request's outputs: 29 for request 2, where counting every fed slot past its prompt as an
    output had made 36. Read pass by pass (the host loop's progress count), the same."""
    prompts, budgets = [35, 23, 25, 12, 13, 10], [15, 34, 29, 37, 25, 28]
    cfg = make_config("chunked", num_slots=3, backend="simulator", clock="passes", loop=loop)
    cfg.policy.token_budget, cfg.policy.long_prefill_threshold = 32, 16
    cfg.memory = MemoryConfig(layout="paged", budget_tokens=144, block_size=16, watermark=0.0)
    res = simulate(cfg, make_workload(prompts, budgets))
    rec, final = res.record, res.final
    assert int(final.num_preemptions[2]) == 1
    np.testing.assert_array_equal(np.asarray(final.num_generated), budgets)
    np.testing.assert_array_equal(np.bincount(rec.req[rec.emits], minlength=6), budgets)
    ends = rec.start_pos + rec.num_tokens
    refed = (rec.req == 2) & (rec.num_tokens > 0) & (ends > 25) & ~rec.emits
    assert refed.sum() == 7  # a chunk into its outputs, then one of them a pass: the 36 - 29
    reached = np.full(6, -1)
    one_by_one = [emitted(rec.req[p : p + 1], rec.num_tokens[p : p + 1],
                          rec.start_pos[p : p + 1], np.array(prompts), reached)[0]
                  for p in range(rec.num_passes)]  # fmt: skip
    np.testing.assert_array_equal(np.array(one_by_one), rec.emits)


@st.composite
def tight_runs(draw):
    n = 10
    prompt = draw(st.lists(st.integers(1, 60), min_size=n, max_size=n))
    budget = draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
    arrival = sorted(draw(st.lists(st.integers(0, 30), min_size=n, max_size=n)))
    block_size = draw(st.sampled_from([4, 16]))
    need = max(blocks_for(p + m - 1, block_size) for p, m in zip(prompt, budget))
    num_blocks = draw(st.integers(need, need + 12))
    return np.array(arrival, float), np.array(prompt), np.array(budget), block_size, num_blocks


def _check_blocks(state, num_blocks):
    table, free = np.asarray(state.block_table), np.asarray(state.block_free)
    owned = table[table >= 0]
    assert len(owned) == len(set(owned.tolist())), "a block is owned twice"
    assert not free[owned].any(), "a table holds a freed block"
    assert free.sum() + len(owned) == num_blocks, "a block leaked"
    # Each held request has the blocks of every token it has cached.
    req = np.asarray(state.slot_req)
    computed = np.asarray(state.num_computed)
    for s in np.flatnonzero(req >= 0):
        have = (table[s] >= 0).sum()
        assert have >= -(-computed[req[s]] // state.memory.block_size)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tight_runs())
def test_block_invariants_under_small_budgets(run):
    arrival, prompt, budget, bs, num_blocks = run
    mem = MemorySpec(num_blocks * bs, 256, "paged", block_size=bs)
    state = init_state(arrival, prompt, budget, np.zeros(10, bool), 4, memory=mem)
    policy = make_policy("continuous")
    schedule, commit = jax.jit(policy.schedule), jax.jit(policy.commit)
    params, tokens = PolicyParams(), jnp.zeros(4, jnp.int32)
    now = 0.0
    for _ in range(2000):
        state, plan = schedule(state.replace(now=np.float32(now)), params)
        _check_blocks(state, num_blocks)
        if int(plan.kind) == 0:
            if not np.isfinite(float(plan.wait_until)):
                break
            now = max(now, float(plan.wait_until))
            continue
        fed = np.asarray(plan.num_tokens) > 0
        assert (np.asarray(state.status)[np.asarray(plan.req)[fed]] == RUNNING).all()
        state = commit(state, plan, tokens, params)
        now += 1.0
    assert (np.asarray(state.status) == FINISHED).all()
    np.testing.assert_array_equal(np.asarray(state.num_generated), budget)
    assert np.asarray(state.block_free).all(), "blocks left allocated at the end"


@pytest.mark.parametrize("reservation, concurrent", [("max_len", 2), ("pow2", 4), ("exact", 7)])
def test_contiguous_reservations_bound_concurrency(reservation, concurrent):
    # Budget 512 positions, max_len 256; each request needs 60 + 10 = 70 positions, which
    # reserves 256 (max_len), 128 (pow2) or 70 (exact): 2, 4 or 7 fit.
    mem = MemoryConfig(layout="contiguous", budget_tokens=512, reservation=reservation)
    res = _run(mem, [60] * 12, [10] * 12, num_slots=12)
    held = (res.record.holder >= 0).sum(axis=1)
    assert held.max() == concurrent
    assert (res.record.kv_reserved <= 512).all()
    assert res.record.kv_reserved.max() == concurrent * {"max_len": 256, "pow2": 128}.get(
        reservation, 70
    )
    assert (np.asarray(res.final.status) == FINISHED).all()


def test_budget_below_one_request_names_the_smallest_that_works():
    prompts, budgets = [80, 90], [5, 20]  # whole needs: 84 -> 96 and 109 -> 112 positions
    with pytest.raises(ConfigError) as err:
        _run(MemoryConfig(layout="paged", budget_tokens=64, block_size=16), prompts, budgets)
    # The test model keeps 256 bytes of KV per position: 96 positions are 0.0234 MiB.
    assert str(err.value) == (
        "memory.budget_tokens=64 is not valid: it holds 64 KV positions but the smallest request "
        "needs 96: use at least 0.0234 MiB (budget_tokens=96); 0.0273 MiB fits every request"
    )
    with pytest.raises(ConfigError, match=r"^memory.budget_mib=0.015625 is not valid"):
        _run(MemoryConfig(layout="paged", budget_mib=0.015625), prompts, budgets)


def test_request_over_the_whole_budget_is_rejected_and_the_rest_finish():
    mem = MemoryConfig(layout="paged", budget_tokens=128, block_size=16)
    res = _run(mem, [20, 150, 30], [5, 5, 5])
    np.testing.assert_array_equal(np.asarray(res.final.status), [FINISHED, 4, FINISHED])
