"""A fused attention kernel's logits against the portable path's, on this machine's accelerator:
`cudnn` on a GPU, `pallas` on a TPU (`--attention auto` picks by platform). Each policy runs the
same requests twice, `model.attention=xla` then the kernel, and prints the largest logit
difference and the share of output tokens that agree. Where no kernel runs (a CPU), it says so
and checks nothing: tests/test_kernels.py checks the kernels' code paths on the CPU. Asserts
nothing; prints `agree` when every difference is within --atol."""

from __future__ import annotations

import argparse
import dataclasses

import jax
import numpy as np
from common import config

from jaxbatch.config import LengthConfig, MemoryConfig
from jaxbatch.model.kernels import choose
from jaxbatch.run import simulate
from jaxbatch.workload import from_config

KERNELS = {"gpu": "cudnn", "tpu": "pallas"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3_2_1b")
    ap.add_argument("--attention", default="auto", help="cudnn, pallas or auto (by platform)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--atol", type=float, default=0.05, help="bfloat16 inputs: 2^-8 relative")
    args = ap.parse_args()
    platform = jax.default_backend()
    kernel = KERNELS.get(platform, "") if args.attention == "auto" else args.attention
    if not kernel:
        print(f"kernel_check: no fused attention kernel for {platform}; nothing to check")
        return
    lengths = LengthConfig(dist="uniform", low=16, high=200)
    outputs = LengthConfig(dist="uniform", low=8, high=32)
    worst = 0.0
    layouts = ("paged",) if kernel == "pallas" else ("contiguous", "paged")
    for policy, layout in [(p, m) for p in ("continuous", "chunked") for m in layouts]:
        cfg = config(policy, args.slots, args.requests, lengths, outputs, args.model)
        cfg.engine.clock, cfg.engine.warmup, cfg.policy.token_budget = "passes", False, 256
        cfg.memory = MemoryConfig(layout=layout, budget_tokens=args.slots * 512)
        chosen, why = choose(kernel, platform, cfg.model.dtype, layout == "paged", 1)
        if why:
            print(f"kernel_check: {kernel} cannot run here: {why}")
            return
        ref, got = (
            simulate(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention=a)),
                     from_config(cfg.workload), with_logits=True)
            for a in ("xla", chosen)
        )  # fmt: skip
        diff, same = _compare(ref, got)
        worst = max(worst, diff)
        print(f"{policy:>11} {layout:>10}, {args.model} {cfg.model.dtype}: {chosen} against xla, "
              f"largest |logit difference| {diff:.4f} (up to each request's first differing "
              f"token), output tokens equal {same:.1%}, "
              f"passes {got.record.num_passes} vs {ref.record.num_passes}")  # fmt: skip
    print(f"kernel_check: {kernel} {'agree' if worst <= args.atol else 'DIFFER'} "
          f"(largest difference {worst:.4f}, atol {args.atol})")  # fmt: skip


def _compare(ref, got) -> tuple[float, float]:
    """The largest logit difference over each request's outputs up to and including its first
    token that differs (after it, the two runs feed different tokens), and the share of output
    tokens that are equal."""
    a, b = ref.request_logits(), got.request_logits()
    diff, equal, total = 0.0, 0, 0
    for i, (x, y) in enumerate(zip(ref.outputs, got.outputs)):
        n = min(len(x), len(y))
        first = int(np.argmax(x[:n] != y[:n])) if (x[:n] != y[:n]).any() else n - 1
        diff = max(diff, float(np.abs(a[i][: first + 1] - b[i][: first + 1]).max()))
        equal, total = equal + int((x[:n] == y[:n]).sum()), total + max(len(x), len(y))
    return diff, equal / total


if __name__ == "__main__":
    main()
