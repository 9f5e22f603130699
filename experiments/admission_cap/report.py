"""The study's table from its sweeps' metrics.json: one row per run."""

import json
import sys
from pathlib import Path

import yaml


def row(run: Path) -> str:
    m = json.loads((run / "metrics.json").read_text())
    p = yaml.safe_load((run / "config.yaml").read_text())["policy"]
    cap = p["max_partial_prefills"]
    label = f"capped {cap}" if p["name"] == "capped" else f"{p['name']} {p['token_budget']}"
    ttft, tpot, itl = m["ttft_s"], m["tpot_s"], m["itl_s"]
    return (f"{label:>12} {m['output_throughput_tok_s']:6.0f} {m['num_passes']:6d} "
            f"{ttft['mean']:9.3f} / {ttft['p99']:6.3f}   "
            f"{1e3 * tpot['p50']:9.2f} / {1e3 * tpot['p99']:6.2f}   "
            f"{1e3 * itl['p99']:8.1f} / {1e3 * itl['max']:6.1f}")  # fmt: skip


def main() -> None:
    print(f"{'run':>12} {'tok/s':>6} {'passes':>6} {'TTFT mean / p99 (s)':>20} "
          f"{'TPOT p50 / p99 (ms)':>20} {'ITL p99 / max (ms)':>19}")  # fmt: skip
    for sweep in sys.argv[1:]:
        runs = sorted(Path(sweep).glob("*/metrics.json"), key=lambda p: int(p.parent.name))
        for path in runs:
            print(row(path.parent))


if __name__ == "__main__":
    main()
