"""After a Hydra multirun: summary.csv (one row per job) and the comparison figures.

A Hydra callback: it reads only the files each job wrote, so it also works on a finished sweep
directory (`summarize_sweep(path)`). It never reruns anything.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from jaxbatch.report.files import load_record
from jaxbatch.report.plots import plot_bars, plot_timelines

HEADLINE = (
    "num_finished", "num_rejected", "num_preemptions", "num_passes", "duration_s",
    "output_throughput_tok_s", "request_throughput_req_s", "slot_utilization", "padding_waste",
    "kv_budget_tokens", "kv_peak_utilization", "kv_peak_live", "kv_mean_waste", "num_compiles",
)  # fmt: skip
LATENCY = ("ttft_s", "tpot_s", "e2e_s")
BARS = ("output_throughput_tok_s", "num_passes", "slot_utilization", "tpot_s.p50")


def _job_dirs(sweep_dir: Path) -> list[Path]:
    dirs = [p.parent for p in sweep_dir.glob("*/metrics.json")]
    return sorted(dirs, key=lambda p: (len(p.name), p.name))


def _label(row: dict) -> str:
    """A job's figure label: its overrides, less those that change no result (output.*)."""
    kept = [o for o in row["overrides"].split() if not o.startswith("output.")]
    return " ".join(kept) or row["job"]


def summarize_sweep(sweep_dir: Path) -> list[dict]:
    """Write summary.csv, timelines.png and metrics.png into sweep_dir; return the rows."""
    rows, panels = [], []
    for job in _job_dirs(sweep_dir):
        metrics = json.loads((job / "metrics.json").read_text())
        overrides_file = job / ".hydra" / "overrides.yaml"
        overrides = OmegaConf.load(overrides_file) if overrides_file.exists() else []
        row = {"job": job.name, "overrides": " ".join(overrides)}
        row.update({k: metrics.get(k) for k in HEADLINE})
        for k in LATENCY:
            for q in ("mean", "p50", "p99"):
                row[f"{k}.{q}"] = metrics[k][q]
        rows.append(row)
        if (job / "record.npz").exists():
            panels.append((_label(row), load_record(job / "record.npz")))
    if not rows:
        return rows
    with (sweep_dir / "summary.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    if panels:
        plot_timelines(panels, sweep_dir / "timelines.png")
    labels = [_label(r) for r in rows]
    plot_bars(labels, {k: [r[k] or 0.0 for r in rows] for k in BARS}, sweep_dir / "metrics.png")
    return rows


class SweepSummary(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        rows = summarize_sweep(Path(config.hydra.sweep.dir))
        print(f"jaxbatch: {len(rows)} runs summarised in {config.hydra.sweep.dir}/summary.csv")
