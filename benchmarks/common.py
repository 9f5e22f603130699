"""Helpers shared by the benchmark scripts: a config on the tiny model and repeated timing."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxbatch.config import (  # noqa: E402
    Config,
    EngineConfig,
    LengthConfig,
    OutputConfig,
    PolicyConfig,
    WorkloadConfig,  # noqa: E402
)


def config(
    policy: str, num_slots: int, n: int, prompt: LengthConfig, output: LengthConfig
) -> Config:
    return Config(
        policy=PolicyConfig(name=policy),
        workload=WorkloadConfig(num_requests=n, prompt=prompt, output=output),
        engine=EngineConfig(num_slots=num_slots),
        output=OutputConfig(progress=False, plots=False),
    )


def median(xs: list[float]) -> float:
    return statistics.median(xs)
