"""How often a request's greedy tokens depend on its neighbours, per compute and KV-cache dtype.

One workload (32 requests, prompts 4..119, outputs 4..39 tokens, seeded) runs three ways: each
request alone (continuous, 1 slot), continuous on 8 slots, and chunked on 8 slots with a 64-token
budget (prompts split across passes). Prints, per `model.dtype` x `model.kv_dtype`, how many
requests and tokens differ between the ways, and where the first difference falls. Also prints
the XLA operation behind it: whether one row of a matmul is bitwise the same at every row count.
Asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.config import (
    Config,
    EngineConfig,
    LengthConfig,
    ModelConfig,
    OutputConfig,
    PolicyConfig,
    WorkloadConfig,
)
from jaxbatch.run import simulate
from jaxbatch.workload import from_config


def run(model: ModelConfig, policy: str, slots: int, workload) -> list[np.ndarray]:
    cfg = Config(
        model=model, policy=PolicyConfig(name=policy, token_budget=64),
        engine=EngineConfig(num_slots=slots, clock="passes", warmup=False, compile_cache="off"),
        output=OutputConfig(progress=False, plots=False),
    )  # fmt: skip
    return simulate(cfg, workload).outputs


def compare(a: list[np.ndarray], b: list[np.ndarray]) -> str:
    differ = [(x != y) for x, y in zip(a, b)]
    firsts = sorted(int(np.argmax(d)) for d in differ if d.any())
    tokens = sum(int(d.sum()) for d in differ)
    return f"{len(firsts):2d} requests, {tokens:3d} tokens (first at token {firsts[:6]})"


def matmul_rows(k: int = 688, n: int = 256) -> str:
    """Row 0 of x[:m] @ w for several m, against m = 2: which row counts change its bits."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    x = rng.standard_normal((256, k)).astype(np.float32)
    f = jax.jit(lambda x, w: x @ w)
    ref = np.asarray(f(x[:2], w))[0]
    diff = {m: float(np.abs(np.asarray(f(x[:m], w))[0] - ref).max()) for m in (1, 4, 16, 17, 64)}
    return ", ".join(f"m={m}: {d:.1e}" for m, d in diff.items())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    args = ap.parse_args()
    length = LengthConfig(dist="uniform", low=4, high=119)
    wl = WorkloadConfig(
        num_requests=args.requests,
        prompt=length,
        output=LengthConfig(dist="uniform", low=4, high=39),
    )
    workload = from_config(wl)
    print(
        f"XLA dot, float32, [m, 688] @ [688, 256]: row 0's largest change from m=2: {matmul_rows()}"
    )
    print(f"{args.requests} requests, {int(workload.max_new.sum())} output tokens, tiny model")
    for dtype, kv in (("float32", "auto"), ("float32", "bfloat16"), ("bfloat16", "auto")):
        model = dataclasses.replace(ModelConfig(), dtype=dtype, kv_dtype=kv)
        alone = run(model, "continuous", 1, workload)
        shared = run(model, "continuous", 8, workload)
        chunked = run(model, "chunked", 8, workload)
        print(f"dtype={dtype:8} kv_dtype={kv:8}: 8 slots vs alone: {compare(shared, alone)}; "
              f"chunked vs continuous: {compare(chunked, shared)}")  # fmt: skip


if __name__ == "__main__":
    main()
