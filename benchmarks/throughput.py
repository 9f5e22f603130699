"""Output tokens/s on the tiny model: 64 offline requests, prompts and outputs uniform in 16..128,
16 slots; `--policies` also takes orca and chunked (their token_budget: `--budget`). Prints the
median of several runs; asserts nothing."""

from __future__ import annotations

import argparse

from common import config, median

from jaxbatch.cli import simulate
from jaxbatch.config import LengthConfig
from jaxbatch.workload import from_config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policies", default="continuous,orca,chunked")
    ap.add_argument("--budget", type=int, default=256)
    args = ap.parse_args()
    lengths = LengthConfig(dist="uniform", low=16, high=128)
    for policy in args.policies.split(","):
        cfg = config(policy, 16, 64, lengths, lengths)
        cfg.policy.token_budget = args.budget
        workload = from_config(cfg.workload)
        runs = [simulate(cfg, workload) for _ in range(args.repeats)]
        tok_s = [r.record.emits.sum() / r.duration_s for r in runs]
        passes = runs[0].record.num_passes
        print(
            f"{policy:>11}: median output {median(tok_s):8.1f} tok/s over {args.repeats} runs "
            f"(min {min(tok_s):.1f}, max {max(tok_s):.1f}); {passes} passes, "
            f"median pass {1e3 * median([r.duration_s / r.record.num_passes for r in runs]):.2f} ms, "
            f"compiles after warm-up {runs[-1].compiles_after_warmup}"
        )


if __name__ == "__main__":
    main()
