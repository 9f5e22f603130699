"""The fused on-device loop against the host loop: identical tokens for every request."""

from __future__ import annotations

import numpy as np
import pytest

from jaxbatch.cli import build_backend, memory_spec, policy_options, simulate
from jaxbatch.fused import run_fused
from jaxbatch.sched.policies import PolicyParams, make_policy
from jaxbatch.sched.state import FINISHED, init_state
from tests.conftest import make_config, make_workload


@pytest.mark.parametrize("policy", ["chunked", "orca"])
def test_fused_loop_tokens_equal_host_loop(policy):
    w = make_workload([30, 7, 45, 12, 3], [6, 9, 4, 7, 5])
    cfg = make_config(policy, num_slots=3, clock="passes", warmup=False)
    cfg.policy.token_budget = 64
    cfg.policy.long_prefill_threshold = 16
    host = simulate(cfg, w)
    memory = memory_spec(cfg)
    state = init_state(w.arrival, w.prompt_len, w.max_new, np.zeros(5, bool), 3, memory=memory)
    runner = build_backend(cfg, w, memory)
    policy_ = make_policy(cfg.policy.name, cfg.policy.queue, **policy_options(cfg))
    fused = run_fused(policy_, PolicyParams(), state, runner, max_passes=200)
    assert (np.asarray(fused.final.status) == FINISHED).all()
    for a, b in zip(fused.outputs, host.outputs):
        np.testing.assert_array_equal(a, b)
    # Same schedule: the same number of passes, the same tokens fed in each.
    assert fused.record.num_passes == host.record.num_passes
    np.testing.assert_array_equal(fused.record.num_tokens, host.record.num_tokens)
