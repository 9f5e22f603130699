"""The shipped model configs compose through Hydra, validate, and have the sizes they state."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from jaxbatch.cli import CONFIG_DIR
from jaxbatch.config import Config, register, validate


def _composed(model: str) -> Config:
    register()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return OmegaConf.to_object(compose("config", overrides=[f"model={model}"]))


@pytest.mark.parametrize(
    "model, params, kv_per_weight",
    [("tiny", 3_950_848, 0.61), ("small", 26_747_392, 0.17)],
)
def test_model_configs_compose_with_their_stated_sizes(model, params, kv_per_weight):
    cfg = _composed(model)
    validate(cfg)
    spec = cfg.model.spec()
    assert cfg.model.name == model and spec.num_params == params
    # KV values a decode pass reads at 8 slots x 256 cached positions, per weight it reads (the
    # embedding table is gathered, not read whole): the ratio each yaml file states.
    kv = 8 * 256 * spec.kv_bytes_per_token / 4
    weights = spec.num_params - spec.vocab_size * spec.d_model
    assert round(kv / weights, 2) == kv_per_weight
