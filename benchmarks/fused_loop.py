"""The same offline workload through the host loop and the fused on-device loop (chunked policy,
tiny model): prints output tokens/s of each (medians, interleaved) and their ratio. The fused
loop's time excludes its compilation, as the host loop's excludes warm-up. Asserts nothing."""

from __future__ import annotations

import argparse

import numpy as np
from common import config, median

from jaxbatch.cli import build_backend, memory_spec, policy_options, simulate
from jaxbatch.config import LengthConfig
from jaxbatch.fused import run_fused
from jaxbatch.sched.policies import PolicyParams, make_policy
from jaxbatch.sched.state import init_state
from jaxbatch.workload import from_config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--prompt", type=int, nargs=2, default=(16, 64))
    ap.add_argument("--output", type=int, nargs=2, default=(16, 128))
    args = ap.parse_args()
    prompt = LengthConfig(dist="uniform", low=args.prompt[0], high=args.prompt[1])
    output = LengthConfig(dist="uniform", low=args.output[0], high=args.output[1])
    cfg = config("chunked", args.slots, 32, prompt, output)
    cfg.policy.token_budget = args.budget
    w = from_config(cfg.workload)
    memory = memory_spec(cfg)
    policy = make_policy("chunked", "fcfs", **policy_options(cfg))
    host, fused = [], []
    for _ in range(args.repeats):
        res = simulate(cfg, w)
        host.append(res.record.emits.sum() / res.duration_s)
        state = init_state(w.arrival, w.prompt_len, w.max_new, np.zeros(len(w), bool), args.slots,
                           memory=memory)  # fmt: skip
        out = run_fused(policy, PolicyParams(), state, build_backend(cfg, w, memory), 4096)
        fused.append(out.record.emits.sum() / out.wall_s)
        same = all((a == b).all() for a, b in zip(out.outputs, res.outputs))
    print(
        f"chunked, budget {args.budget}, 32 offline requests, {args.slots} slots, {res.record.num_passes} passes"
    )
    print(f"host loop:  median {median(host):8.1f} tok/s")
    print(
        f"fused loop: median {median(fused):8.1f} tok/s (compile {out.compile_s:.1f} s, excluded)"
    )
    print(f"fused / host = {median(fused) / median(host):.2f}; identical tokens: {same}")


if __name__ == "__main__":
    main()
