"""A model trained here with optax and saved with orbax: exact save/restore, a short training that
learns, and a trained model's answers (ended by its own EOS) under every policy and memory layout
equal to the same model serving one request at a time."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxbatch import tasks
from jaxbatch.config import ConfigError, MemoryConfig, WorkloadConfig, validate
from jaxbatch.model.checkpoint import TrainedCheckpointError, load_trained, save_trained
from jaxbatch.model.transformer import init_params
from jaxbatch.run import simulate
from jaxbatch.train import train
from jaxbatch.workload import from_config
from tests.conftest import MODEL_LAYERS, TEST_MODEL, make_config

# Two layers: one learns the tasks too slowly for a short training.
MODEL = dataclasses.replace(TEST_MODEL, n_layers=MODEL_LAYERS)
SPEC = MODEL.spec()
STEPS = 600


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_parameters_save_and_restore_exactly(tmp_path, dtype):
    spec = dataclasses.replace(SPEC, dtype=dtype)
    params = init_params(spec, 3)
    save_trained(tmp_path, params, spec, {"note": "test"})
    back = load_trained(tmp_path, spec)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(TrainedCheckpointError, match="model.json has d_mlp=128, the config 96"):
        load_trained(tmp_path, dataclasses.replace(spec, d_mlp=96))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The test model trained for a few seconds on the three tasks, up to 4 digits."""
    params, history = train(SPEC, steps=STEPS, batch_size=32, max_digits=4, lr=3e-3, warmup=30,
                            log_every=100, progress=False)  # fmt: skip
    path = tmp_path_factory.mktemp("trained")
    save_trained(path, params, SPEC, {"history": history})
    return path, history


def test_a_short_training_lowers_the_held_out_loss(trained):
    _, history = trained
    first, last = history[0], history[-1]
    # Before training, about the loss of a uniform guess over 256 ids: ln 256 = 5.5.
    assert (first["step"], last["step"]) == (0, STEPS)
    assert first["held_out_loss"] > 5.0 and first["held_out_accuracy"] == 0.0
    assert last["held_out_loss"] < 0.2 and last["held_out_accuracy"] > 0.8


def _task_run(checkpoint, policy, memory, num_slots):
    cfg = make_config(policy, num_slots=num_slots, clock="passes")
    cfg.model = dataclasses.replace(MODEL, checkpoint=str(checkpoint), eos_id=tasks.EOS)
    cfg.workload = WorkloadConfig(kind="task", num_requests=10, max_digits=4, seed=5)
    cfg.memory, cfg.policy.token_budget = memory, 16
    validate(cfg)
    workload = from_config(cfg.workload)
    res = simulate(cfg, workload)
    right = [tasks.is_correct(workload.tokens[i], out) for i, out in enumerate(res.outputs)]
    return res.outputs, right


MEMORY = {"contiguous": MemoryConfig(), "paged": MemoryConfig(layout="paged", budget_tokens=192)}


@pytest.mark.parametrize("memory", MEMORY)
def test_answers_under_every_policy_equal_serving_one_request_at_a_time(trained, memory):
    path, _ = trained
    alone, right_alone = _task_run(path, "continuous", MEMORY[memory], 1)
    lengths = {len(out) for out in alone}
    assert len(lengths) > 1  # the model's EOS, not the budget, ended the answers
    assert np.mean(right_alone) > 0.5
    for policy in ("static", "continuous", "orca", "chunked"):
        outputs, right = _task_run(path, policy, MEMORY[memory], 4)
        assert right == right_alone, policy
        for a, b in zip(outputs, alone):
            np.testing.assert_array_equal(a, b)


def test_a_trained_model_needs_its_checkpoint(tmp_path):
    cfg = make_config()
    cfg.model = dataclasses.replace(cfg.model, name="tiny_trained")
    with pytest.raises(ConfigError, match="model.checkpoint='' .*jaxbatch-train"):
        validate(cfg)
    cfg.model = dataclasses.replace(cfg.model, checkpoint=str(tmp_path))
    validate(cfg)
    with pytest.raises(ConfigError, match="model.checkpoint=.*no model.json and params/"):
        simulate(cfg, from_config(WorkloadConfig(kind="task", num_requests=2)))
