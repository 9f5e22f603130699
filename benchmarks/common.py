"""Helpers shared by the benchmark scripts: a config on one of the repository's models, a decode
plan, medians.

A model name is a config of `configs/model/` (tiny, small), optionally with `-kvN` for N KV heads
and `-bf16` for bfloat16 weights, matmul inputs and KV cache: `tiny-kv4` is the tiny model with
plain multi-head attention (one query head per KV head), `tiny-kv4-bf16` the same in bfloat16."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from jaxbatch.config import (  # noqa: E402
    Config,
    EngineConfig,
    LengthConfig,
    ModelConfig,
    OutputConfig,
    PolicyConfig,
    WorkloadConfig,
    model_preset,
)
from jaxbatch.model.spec import ModelSpec  # noqa: E402
from jaxbatch.sched.state import DECODE, Plan  # noqa: E402


def model_config(model: str) -> ModelConfig:
    """A model name (see above) as its config."""
    name, *options = model.split("-")
    cfg = model_preset(name)
    for option in options:
        if option.startswith("kv") and option[2:].isdigit():
            cfg.n_kv_heads = int(option[2:])
        elif option == "bf16":
            cfg.dtype = "bfloat16"
        else:
            raise SystemExit(f"model {model!r}: unknown option {option!r} (valid: kvN, bf16)")
    return cfg


def model_spec(model: str) -> ModelSpec:
    return model_config(model).spec()


def config(
    policy: str,
    num_slots: int,
    n: int,
    prompt: LengthConfig,
    output: LengthConfig,
    model: str = "tiny",
) -> Config:
    """`model`: a model name (see above)."""
    return Config(
        model=model_config(model),
        policy=PolicyConfig(name=policy),
        workload=WorkloadConfig(num_requests=n, prompt=prompt, output=output),
        engine=EngineConfig(num_slots=num_slots),
        output=OutputConfig(progress=False, plots=False),
    )


def decode_plan(num_slots: int, pos: int, block_table: np.ndarray | None = None) -> Plan:
    """Slot i decodes request i's token at position `pos` (no blocks unless given)."""
    b = num_slots
    table = np.zeros((b, 0), np.int32) if block_table is None else block_table
    req = np.arange(b, dtype=np.int32)
    return Plan(req, np.ones(b, np.int32), np.full(b, pos, np.int32), np.int32(DECODE),
                np.float32(0), table)  # fmt: skip


def median(xs: list[float]) -> float:
    return statistics.median(xs)
