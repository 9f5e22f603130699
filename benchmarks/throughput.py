"""Output tokens/s of every policy on one realistic offline workload, measured side by side in one
process: 64 requests, prompts and output budgets uniform in 16..128, 16 slots, the tiny model with
4 KV heads (plain multi-head attention, as Llama-2 7B). orca and chunked take `--budget` tokens a
pass. Prints each policy's median over interleaved runs, its passes and median pass time, and its
share of continuous batching's throughput. Asserts nothing."""

from __future__ import annotations

import argparse

from common import config, median

from jaxbatch.config import LengthConfig
from jaxbatch.run import simulate
from jaxbatch.workload import from_config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policies", default="static,continuous,orca,chunked")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--model", default="tiny-kv4", help="tiny, small, tiny-kv4, ... (common.py)")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--lengths", type=int, nargs=2, default=(16, 128), metavar=("LOW", "HIGH"))
    args = ap.parse_args()
    lengths = LengthConfig(dist="uniform", low=args.lengths[0], high=args.lengths[1])
    policies = args.policies.split(",")
    tok_s, runs = {p: [] for p in policies}, {}
    for _ in range(args.repeats):  # interleaved, so drift hits every policy alike
        for policy in policies:
            cfg = config(policy, args.slots, args.requests, lengths, lengths, args.model)
            cfg.policy.token_budget = args.budget
            res = simulate(cfg, from_config(cfg.workload))
            tok_s[policy].append(res.record.emits.sum() / res.duration_s)
            runs.setdefault(policy, []).append(res)
    ref = median(tok_s["continuous"]) if "continuous" in tok_s else None
    print(f"{args.model}, {args.requests} requests, {args.slots} slots, prompts and outputs "
          f"uniform in {args.lengths[0]}..{args.lengths[1]}, token budget {args.budget}")  # fmt: skip
    for policy in policies:
        rs, t = runs[policy], tok_s[policy]
        share = f", {median(t) / ref:.1%} of continuous" if ref else ""
        print(
            f"{policy:>11}: median output {median(t):8.1f} tok/s over {args.repeats} runs "
            f"(min {min(t):.1f}, max {max(t):.1f}){share}; {rs[0].record.num_passes} passes, "
            f"median pass {1e3 * median([r.duration_s / r.record.num_passes for r in rs]):.2f} ms, "
            f"warm-up {median([r.warmup_s for r in rs]):.1f} s, "
            f"compiles after warm-up {rs[-1].compiles_after_warmup}"
        )


if __name__ == "__main__":
    main()
