"""After a Hydra multirun: summary.csv (one row per job) and the comparison figures.

A Hydra callback: it reads only the files each job wrote, so it also works on a finished sweep
directory (`summarize_sweep(path)`). It never reruns anything. A job that failed (error.json) has
a row with its error; one that was interrupted (metrics.json says so) has its partial metrics.
"""

from __future__ import annotations

import csv
import json
import sys
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


COLUMNS = (
    "job", "overrides", "status", "error", *HEADLINE,
    *(f"{k}.{q}" for k in LATENCY for q in ("mean", "p50", "p99")),
)  # fmt: skip


def _job_dirs(sweep_dir: Path) -> list[Path]:
    dirs = {
        p.parent for name in ("metrics.json", "error.json") for p in sweep_dir.glob(f"*/{name}")
    }
    return sorted(dirs, key=lambda p: (len(p.name), p.name))


def _labels(rows: list[dict]) -> list[str]:
    """Each job's figure label: the overrides that tell it from the sweep's other jobs, less those
    that change no result (output.*)."""
    split = [r["overrides"].split() for r in rows]
    shared = set.intersection(*map(set, split)) if len(rows) > 1 else set()
    kept = [[o for o in s if o not in shared and not o.startswith("output.")] for s in split]
    return [" ".join(k) or r["job"] for k, r in zip(kept, rows)]


def summarize_sweep(sweep_dir: Path) -> list[dict]:
    """Write summary.csv, timelines.png and metrics.png into sweep_dir; return the rows."""
    rows, panels = [], []
    for job in _job_dirs(sweep_dir):
        overrides_file = job / ".hydra" / "overrides.yaml"
        overrides = OmegaConf.load(overrides_file) if overrides_file.exists() else []
        row = dict.fromkeys(COLUMNS)
        row.update(job=job.name, overrides=" ".join(overrides))
        if (job / "error.json").exists():
            row.update(status="failed", error=json.loads((job / "error.json").read_text())["error"])
            rows.append(row)
            continue
        metrics = json.loads((job / "metrics.json").read_text())
        row["status"] = "interrupted" if metrics.get("interrupted") else "finished"
        row.update({k: metrics.get(k) for k in HEADLINE})
        for k in LATENCY:
            for q in ("mean", "p50", "p99"):
                row[f"{k}.{q}"] = metrics[k][q]
        rows.append(row)
        if (job / "record.npz").exists():
            panels.append((row, load_record(job / "record.npz")))
    if not rows:
        return rows
    with (sweep_dir / "summary.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    labels = _labels(rows)
    label_of = dict(zip([r["job"] for r in rows], labels))
    if panels:
        plot_timelines(
            [(label_of[r["job"]], rec) for r, rec in panels], sweep_dir / "timelines.png"
        )
    plot_bars(labels, {k: [r[k] or 0.0 for r in rows] for k in BARS}, sweep_dir / "metrics.png")
    return rows


class SweepSummary(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        rows = summarize_sweep(Path(config.hydra.sweep.dir))
        print(f"jaxbatch: {len(rows)} runs summarised in {config.hydra.sweep.dir}/summary.csv")
        failed = [r["job"] for r in rows if r["status"] == "failed"]
        if failed:  # the sweep ran every job, but a script must see that some failed
            print(f"jaxbatch: {len(failed)} of {len(rows)} jobs failed (jobs {', '.join(failed)}): "
                  "see the error column of summary.csv", file=sys.stderr)  # fmt: skip
            sys.exit(1)
