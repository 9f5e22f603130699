"""Checkpoints and resume (resume.py): a host-loop run with arrivals and paged memory under
preemption, stopped (Ctrl-C's path) or killed after a periodic checkpoint, then resumed, gives
exactly the uninterrupted run: tokens, plans, pass shapes and per-request pass indices."""

from __future__ import annotations

import dataclasses
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from jaxbatch.config import ConfigError, MemoryConfig, WorkloadConfig, validate
from jaxbatch.resume import _placed_as, config_of, latest_step
from jaxbatch.run import simulate
from jaxbatch.workload import from_config
from tests.conftest import make_config


def _config():
    cfg = make_config("continuous", num_slots=3, clock="passes")
    cfg.workload = WorkloadConfig(num_requests=9, arrival="poisson", rate=0.5, seed=3)
    cfg.workload.prompt.dist, cfg.workload.prompt.low, cfg.workload.prompt.high = "uniform", 8, 60
    cfg.workload.output.dist, cfg.workload.output.low, cfg.workload.output.high = "uniform", 4, 30
    cfg.memory = MemoryConfig(layout="paged", budget_tokens=160, block_size=16, watermark=0.0)
    validate(cfg)
    return cfg


def _stop_after(calls: int):
    seen = iter(range(calls))
    return lambda: next(seen, None) is None


@pytest.fixture(scope="module")
def uninterrupted():
    cfg = _config()
    return simulate(cfg, from_config(cfg.workload))


def _equal(a, b):
    for name in ("req", "num_tokens", "start_pos", "kind", "holder", "rows", "row_tokens",
                 "context", "start", "kv_tokens", "kv_reserved", "emits"):  # fmt: skip
        np.testing.assert_array_equal(getattr(a.record, name), getattr(b.record, name), name)
    for x, y in zip(a.outputs, b.outputs, strict=True):
        np.testing.assert_array_equal(x, y)
    for name in ("status", "num_generated", "num_preemptions"):
        np.testing.assert_array_equal(getattr(a.final, name), getattr(b.final, name), name)


@pytest.mark.parametrize("killed", [False, True], ids=["stopped", "killed"])
def test_a_resumed_run_equals_the_uninterrupted_run(tmp_path, uninterrupted, killed):
    assert np.asarray(uninterrupted.final.num_preemptions).sum() > 0  # memory binds
    cfg = _config()
    cfg.output.checkpoint_every = 7
    first = simulate(cfg, from_config(cfg.workload), stop=_stop_after(40),
                     checkpoint_dir=tmp_path / "checkpoint")  # fmt: skip
    assert first.interrupted and 14 < first.record.num_passes < uninterrupted.record.num_passes
    stopped_at = latest_step(tmp_path / "checkpoint")
    assert stopped_at == first.record.num_passes  # Ctrl-C's checkpoint: where the run stopped
    if killed:  # as if the process died after its last periodic checkpoint
        shutil.rmtree(tmp_path / "checkpoint" / str(stopped_at))
        assert latest_step(tmp_path / "checkpoint") == 7 * (stopped_at // 7)
    resumed_cfg = config_of(str(tmp_path))
    assert dataclasses.replace(resumed_cfg, resume="") == cfg
    # Stopped at once, a resumed run holds exactly what its checkpoint held.
    at_once = simulate(resumed_cfg, from_config(resumed_cfg.workload), stop=_stop_after(0))
    assert at_once.record.num_passes == latest_step(tmp_path / "checkpoint")
    if not killed:
        _equal(at_once, first)
    resumed = simulate(resumed_cfg, from_config(resumed_cfg.workload),
                       checkpoint_dir=tmp_path / "again")  # fmt: skip
    _equal(resumed, uninterrupted)
    assert not (tmp_path / "again").exists()  # a finished run leaves no checkpoint


def test_resume_needs_a_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match=r"resume=.* is not valid: no checkpoint in"):
        config_of(str(tmp_path))
    cfg = _config()
    cfg.engine.loop, cfg.output.checkpoint_every = "device", 5
    with pytest.raises(ConfigError, match="engine.loop='device'.*need the host loop"):
        validate(cfg)


def test_a_bfloat16_cache_saved_on_another_platform_is_restored_bit_for_bit():
    """A bfloat16 KV cache is stored as bfloat16 on a GPU or TPU and as its bit patterns (uint16)
    on the CPU (`kvcache.storage_dtype`): restored into the other storage, it keeps its bits,
    never a numeric cast."""
    values = jnp.array([1.5, -2.25, 3e-3, 0.0], jnp.bfloat16)
    bits = np.asarray(values).view(np.uint16)
    as_bits = _placed_as(np.asarray(values), jnp.zeros(4, jnp.uint16))
    assert as_bits.dtype == jnp.uint16 and (np.asarray(as_bits) == bits).all()
    as_values = _placed_as(bits, jnp.zeros(4, jnp.bfloat16))
    assert as_values.dtype == jnp.bfloat16 and (np.asarray(as_values) == np.asarray(values)).all()
