"""Plot the chunked-prefill study: TTFT and TPOT (p50, p99) and output throughput per run."""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sweeps", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    rows = []
    for sweep in args.sweeps:
        for row in csv.DictReader((sweep / "summary.csv").open()):
            opts = dict(o.split("=", 1) for o in row["overrides"].split())
            label = opts["policy"]
            if "policy.token_budget" in opts and label != "continuous":
                label += f" {opts['policy.token_budget']}"
            rows.append((label, row))
    print(f"{'run':>14} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} (ms)")
    for label, r in rows:
        ms = lambda k: 1e3 * float(r[k])  # noqa: E731
        print(
            f"{label:>14} {float(r['output_throughput_tok_s']):8.1f} {ms('ttft_s.p50'):9.1f} "
            f"{ms('ttft_s.p99'):9.1f} {ms('tpot_s.p50'):9.2f} {ms('tpot_s.p99'):9.2f}"
        )
    labels = [label for label, _ in rows]
    panels = [("TTFT (ms)", "ttft_s"), ("TPOT (ms)", "tpot_s")]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    x = range(len(rows))
    for ax, (title, key) in zip(axes, panels):
        ax.bar([i - 0.2 for i in x], [1e3 * float(r[f"{key}.p50"]) for _, r in rows], 0.4, label="p50")
        ax.bar([i + 0.2 for i in x], [1e3 * float(r[f"{key}.p99"]) for _, r in rows], 0.4, label="p99")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    axes[2].bar(x, [float(r["output_throughput_tok_s"]) for _, r in rows], color="tab:green")
    axes[2].set_title("output tokens/s", fontsize=10)
    for ax in axes:
        ax.set_xticks(list(x), labels, rotation=30, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
