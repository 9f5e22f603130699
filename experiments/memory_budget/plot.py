"""Plot a memory-budget sweep: output throughput and mean TPOT against the KV budget, one line
per memory layout, one column per workload; print the KV waste of each layout."""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read(sweep: Path) -> dict[str, list[dict]]:
    lines = defaultdict(list)
    for row in csv.DictReader((sweep / "summary.csv").open()):
        opts = dict(o.split("=", 1) for o in row["overrides"].split())
        row["budget_mib"] = float(opts["memory.budget_mib"])
        lines[opts["memory"]].append(row)
    return {k: sorted(v, key=lambda r: r["budget_mib"]) for k, v in lines.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sweeps", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    fig, axes = plt.subplots(2, len(args.sweeps), figsize=(5.5 * len(args.sweeps), 6.5), squeeze=False)
    for col, sweep in enumerate(args.sweeps):
        lines = read(sweep)
        print(f"== {sweep.name}")
        for layout, rows in lines.items():
            x = [r["budget_mib"] for r in rows]
            tput = [float(r["output_throughput_tok_s"]) for r in rows]
            tpot = [1e3 * float(r["tpot_s.mean"] or "nan") for r in rows]
            axes[0, col].plot(x, tput, marker="o", label=layout)
            axes[1, col].plot(x, tpot, marker="o", label=layout)
            for r in rows:
                print(
                    f"{layout:>17} {r['budget_mib']:5.0f} MiB: {float(r['output_throughput_tok_s']):7.1f} tok/s, "
                    f"TPOT {1e3 * float(r['tpot_s.mean'] or 'nan'):6.2f} ms, KV waste {float(r['kv_mean_waste']):6.1%}, "
                    f"peak granted {float(r['kv_peak_utilization']):6.1%}, preemptions {r['num_preemptions']}, "
                    f"rejected {r['num_rejected']}"
                )
        axes[0, col].set_title(sweep.name, fontsize=10)
        axes[1, col].set_xlabel("KV budget (MiB)")
        for ax in axes[:, col]:
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("output tokens/s")
    axes[1, 0].set_ylabel("mean TPOT (ms)")
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
