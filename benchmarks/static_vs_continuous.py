"""Static vs continuous batching on one offline workload (the default: 32 requests, 8 slots,
32-token prompts, outputs uniform in 8..256, tiny model), measured side by side in one process.
The realistic workload of benchmarks/throughput.py: `--model tiny-kv4 --slots 16 --requests 64
--prompt 16 128 --output 16 128` (varied prompt lengths, plain multi-head attention).

Ideal ratio, from the workload alone: static passes = sum over FCFS batches of the longest output
budget; continuous passes = total output tokens / slots + the prefill passes it ran. Prints the
measured throughput ratio and its share of the ideal, split in two factors whose product it is:
  - packing: the pass-count ratio over the ideal (below 1 by continuous's tail, where fewer
    requests are left than slots: a larger `--requests` shrinks it);
  - pass cost: static's mean pass time over continuous's (below 1 because continuous keeps more
    cached context live in each pass, and a decode pass reads it all; the share this takes of a
    pass is larger on the tiny model than on `--model small` or a production LLM).
Asserts nothing.
"""

from __future__ import annotations

import argparse

from common import config, median

from jaxbatch.config import LengthConfig
from jaxbatch.run import simulate
from jaxbatch.sched.state import PREFILL
from jaxbatch.workload import from_config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--model", default="tiny", help="tiny, small, tiny-kv4, ... (common.py)")
    ap.add_argument("--prompt", type=int, nargs=2, default=(32, 32), metavar=("LOW", "HIGH"))
    ap.add_argument("--output", type=int, nargs=2, default=(8, 256), metavar=("LOW", "HIGH"))
    args = ap.parse_args()
    prompt, output = (
        LengthConfig(dist="fixed", mean=lo)
        if lo == hi
        else LengthConfig("uniform", low=lo, high=hi)
        for lo, hi in (args.prompt, args.output)
    )
    b = args.slots
    tok_s, pass_s, runs = {}, {}, {}
    for _ in range(args.repeats):
        for policy in ("static", "continuous"):  # interleaved, so drift hits both alike
            cfg = config(policy, b, args.requests, prompt, output, args.model)
            res = simulate(cfg, from_config(cfg.workload))
            tok_s.setdefault(policy, []).append(res.record.emits.sum() / res.duration_s)
            pass_s.setdefault(policy, []).append(res.duration_s / res.record.num_passes)
            runs[policy] = res
    budget = from_config(cfg.workload).max_new
    static_ideal = sum(budget[i : i + b].max() for i in range(0, len(budget), b))
    prefills = int((runs["continuous"].record.kind == PREFILL).sum())
    cont_ideal = budget.sum() / b + prefills
    ideal = static_ideal / cont_ideal
    for policy in ("static", "continuous"):
        r = runs[policy]
        print(
            f"{policy:>11}: median {median(tok_s[policy]):8.1f} tok/s, {r.record.num_passes} "
            f"passes, slot utilisation {(r.record.num_tokens > 0).mean():.1%}"
        )
    measured = median(tok_s["continuous"]) / median(tok_s["static"])
    pass_ratio = runs["static"].record.num_passes / runs["continuous"].record.num_passes
    print(
        f"ideal passes: static {static_ideal}, continuous {budget.sum()}/{b} + {prefills} prefill"
    )
    print(f"ideal ratio {ideal:.3f}; pass-count ratio {pass_ratio:.3f}")
    print(
        f"{args.model} model, {args.requests} requests: measured throughput ratio {measured:.3f}"
        f" = {measured / ideal:.1%} of ideal"
    )
    mean = {p: median(pass_s[p]) * 1e3 for p in pass_s}  # per run: its duration / its passes
    print(
        f"= packing {pass_ratio / ideal:.1%} (pass-count ratio / ideal) x pass cost "
        f"{measured / pass_ratio:.1%} (mean pass: static {mean['static']:.2f} ms, continuous "
        f"{mean['continuous']:.2f} ms)"
    )


if __name__ == "__main__":
    main()
