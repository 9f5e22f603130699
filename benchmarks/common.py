"""Helpers shared by the benchmark scripts: a config on one of the repository's models, medians."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omegaconf import OmegaConf  # noqa: E402

from jaxbatch.cli import CONFIG_DIR  # noqa: E402
from jaxbatch.config import (  # noqa: E402
    Config,
    EngineConfig,
    LengthConfig,
    ModelConfig,
    OutputConfig,
    PolicyConfig,
    WorkloadConfig,
)


def config(
    policy: str,
    num_slots: int,
    n: int,
    prompt: LengthConfig,
    output: LengthConfig,
    model: str = "tiny",
) -> Config:
    """`model`: a config of `configs/model/` (tiny, small)."""
    fields = OmegaConf.to_container(OmegaConf.load(Path(CONFIG_DIR) / "model" / f"{model}.yaml"))
    return Config(
        model=ModelConfig(**fields),
        policy=PolicyConfig(name=policy),
        workload=WorkloadConfig(num_requests=n, prompt=prompt, output=output),
        engine=EngineConfig(num_slots=num_slots),
        output=OutputConfig(progress=False, plots=False),
    )


def median(xs: list[float]) -> float:
    return statistics.median(xs)
