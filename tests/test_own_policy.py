"""A policy of one's own (`experiments/admission_cap/policy.py`, registered from a config's
`policy.module`): it runs through the same loops, backends and sweeps as the package's policies,
keeps its own rule, and is never loaded from the compile store under a stale key."""

from __future__ import annotations

import hashlib
import json
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from jaxbatch.cli import execute
from jaxbatch.config import ConfigError, validate
from jaxbatch.run import simulate, simulate_sweep, sweep_key
from jaxbatch.sched.policies import budgeted_schedule, built_in, make_policy, register_policy
from jaxbatch.sched.state import FINISHED, PREFILL
from tests.conftest import make_config, make_workload

EXAMPLE = str(Path(__file__).resolve().parents[1] / "experiments/admission_cap/policy.py")
PROMPTS = [40, 7, 120, 33, 9, 64, 18, 90]
BUDGETS = [12, 30, 5, 20, 8, 15, 25, 3]
PLAN_FIELDS = ("kind", "req", "num_tokens", "start_pos", "holder", "emits", "kv_tokens")


def _capped(cap: int, **engine):
    cfg = make_config("continuous", num_slots=4, **engine)
    cfg.policy.module, cfg.policy.name, cfg.policy.max_partial_prefills = EXAMPLE, "capped", cap
    validate(cfg)  # loads the file, which registers `capped`
    return cfg


def _equal(a, b) -> None:
    assert a.num_passes == b.num_passes
    for field in PLAN_FIELDS:
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)


def test_the_cap_bounds_each_prefill_and_no_cap_is_continuous():
    w = make_workload(PROMPTS, BUDGETS)
    sim = dict(backend="simulator", clock="passes")
    continuous = simulate(make_config("continuous", num_slots=4, **sim), w)
    _equal(simulate(_capped(0, **sim), w).record, continuous.record)
    for cap in (1, 2):
        run = simulate(_capped(cap, **sim), w)
        rec = run.record
        prompts_fed = (rec.num_tokens > 0).sum(axis=1)[rec.kind == PREFILL]
        assert prompts_fed.max() == cap  # the burst of 8 arrivals, `cap` a pass
        assert (np.asarray(run.final.status) == FINISHED).all()
        assert int(rec.emits.sum()) == sum(BUDGETS)
        assert rec.num_passes > continuous.record.num_passes  # more, smaller prefill passes


def test_both_loops_run_it_alike_with_arrivals_and_it_is_never_stored():
    w = make_workload(PROMPTS, BUDGETS, arrival=[0.0, 0.0, 1.5, 2.0, 2.0, 7.25, 9.0, 30.0])
    host = simulate(_capped(1, backend="simulator", clock="passes", loop="host"), w)
    device = simulate(_capped(1, backend="simulator", clock="passes", loop="device"), w)
    _equal(device.record, host.record)
    # a registered policy's code is not in the compile store's keys: compiled, never loaded
    assert built_in(make_policy("capped")) is None
    assert built_in(make_policy("continuous")) == ("make_policy", "continuous", "fcfs")


def test_its_tokens_equal_continuous_on_the_runner():
    w = make_workload([20, 30, 25, 18, 31], [6, 9, 4, 7, 5])  # one prompt bucket: few shapes
    capped = simulate(_capped(1, clock="passes"), w)
    continuous = simulate(make_config("continuous", num_slots=4, clock="passes"), w)
    assert capped.record.num_passes > continuous.record.num_passes
    for a, b in zip(capped.outputs, continuous.outputs, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_sweep_over_its_cap_is_one_program_equal_to_its_runs():
    cfgs = [_capped(cap, backend="simulator", clock="passes", loop="device") for cap in (0, 1, 3)]
    assert len({sweep_key(c) for c in cfgs}) == 1
    w = make_workload(PROMPTS, BUDGETS)
    for cfg, member in zip(cfgs, simulate_sweep(cfgs, [w] * 3), strict=True):
        _equal(member.record, simulate(cfg, w).record)


def test_a_budgeted_policy_registered_in_code_gets_the_mixed_passes_of_its_budget():
    """Registered from code (no module file), `budgeted=True`: the backend prepares mixed passes
    of the token budget's rows and the budget is checked against the slots, as for chunked."""
    register_policy("chunked_again", partial(budgeted_schedule, whole_prompts=False), budgeted=True)
    w = make_workload(PROMPTS, BUDGETS)
    runs = {}
    for name in ("chunked", "chunked_again"):
        cfg = make_config(name, num_slots=4, backend="simulator", clock="passes")
        cfg.policy.token_budget = 64
        validate(cfg)
        runs[name] = simulate(cfg, w).record
    _equal(runs["chunked_again"], runs["chunked"])
    np.testing.assert_array_equal(runs["chunked_again"].rows, runs["chunked"].rows)
    assert runs["chunked_again"].rows.max() == 64  # the budget's rows
    cfg.policy.token_budget = 2
    with pytest.raises(ConfigError, match=r"policy\.token_budget=2 .*>= engine\.num_slots=4"):
        validate(cfg)


def test_a_run_of_it_records_the_file_it_loaded(tmp_path):
    """Its code is not jaxbatch's, so the git revision does not name it: provenance.json (and
    metrics.json) give the file and its SHA-256."""
    execute(_capped(2, backend="simulator", clock="passes"), tmp_path)
    ran_on = json.loads((tmp_path / "provenance.json").read_text())
    assert ran_on["policy_module"] == {
        "name": EXAMPLE, "file": EXAMPLE,
        "sha256": hashlib.sha256(Path(EXAMPLE).read_bytes()).hexdigest(),
    }  # fmt: skip
    assert json.loads((tmp_path / "metrics.json").read_text())["provenance"] == ran_on


def test_bad_policy_modules_and_names_get_one_message(tmp_path):
    cfg = make_config("continuous")
    cfg.policy.module = str(tmp_path / "missing.py")
    with pytest.raises(ConfigError, match=r"policy\.module=.*missing\.py.*could not load it"):
        validate(cfg)
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('no policy here')\n")
    cfg.policy.module = str(broken)
    with pytest.raises(ConfigError, match=r"policy\.module=.*RuntimeError: no policy here"):
        validate(cfg)
    cfg = make_config("continuous")
    cfg.policy.module, cfg.policy.name = EXAMPLE, "cappd"
    with pytest.raises(ConfigError, match=r"policy\.name='cappd'.*static, continuous.*capped"):
        validate(cfg)
    with pytest.raises(ValueError, match="'continuous' is already a policy"):
        register_policy("continuous", lambda state, params, queue="fcfs": None)
