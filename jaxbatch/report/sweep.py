"""After a Hydra multirun: summary.csv (one row per job) and the comparison figures.

A Hydra callback, and `jaxbatch-report DIR` (report/rebuild.py): it reads only the files each job
wrote, so it also works on a sweep directory copied from elsewhere or interrupted. It never reruns
anything. A job that failed (error.json) has a row with its error; one that was interrupted
(metrics.json says so) has its partial metrics; a job directory with neither file, or with one
that does not parse, is skipped, and `Summary.skipped` says why.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from jaxbatch.report.files import load_record
from jaxbatch.report.plots import plot_against, plot_bars, plot_cdfs, plot_timelines, plot_tradeoff

HEADLINE = (
    "num_finished", "num_rejected", "num_preemptions", "num_passes", "duration_s",
    "output_throughput_tok_s", "request_throughput_req_s", "slot_utilization", "padding_waste",
    "kv_budget_tokens", "kv_peak_utilization", "kv_peak_live", "kv_mean_waste", "num_compiles",
    "task_accuracy",
)  # fmt: skip
LATENCY = ("ttft_s", "tpot_s", "e2e_s")
BARS = ("output_throughput_tok_s", "num_passes", "slot_utilization", "tpot_s.p50")
# What `by_<field>.png` plots against each swept field, unless asked for others.
AGAINST = ("output_throughput_tok_s", "ttft_s.p50", "tpot_s.p50", "e2e_s.p99")


COLUMNS = (
    "job", "overrides", "status", "error", *HEADLINE,
    *(f"{k}.{q}" for k in LATENCY for q in ("mean", "p50", "p99")),
)  # fmt: skip


class Summary(NamedTuple):
    rows: list[dict]  # one per job, as summary.csv holds them
    skipped: list[tuple[str, str]]  # (job directory, why it has no row)


def _job_dirs(sweep_dir: Path) -> tuple[list[Path], list[tuple[str, str]]]:
    """The job directories that have a row, and those skipped with why. A directory that is
    itself a run (its own metrics.json) is a sweep of one."""
    if (sweep_dir / "metrics.json").exists():
        candidates = [sweep_dir]
    else:
        candidates = [p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]
    jobs, skipped = [], []
    for job in sorted(candidates, key=lambda p: (len(p.name), p.name)):
        found = [n for n in ("metrics.json", "error.json") if (job / n).exists()]
        if not found:
            if (job / ".hydra").exists():
                skipped.append((job.name, "no metrics.json or error.json: the job never ended"))
            continue
        try:
            json.loads((job / found[0]).read_text())
        except (OSError, ValueError) as err:
            skipped.append((job.name, f"{found[0]} does not parse ({err})"))
            continue
        jobs.append(job)
    return jobs, skipped


def _labels(rows: list[dict]) -> list[str]:
    """Each job's figure label: the overrides that tell it from the sweep's other jobs, less those
    that change no result (output.*)."""
    split = [r["overrides"].split() for r in rows]
    shared = set.intersection(*map(set, split)) if len(rows) > 1 else set()
    kept = [[o for o in s if o not in shared and not o.startswith("output.")] for s in split]
    return [" ".join(k) or r["job"] for k, r in zip(kept, rows)]


def summarize_sweep(sweep_dir: Path, against: tuple[str, ...] = AGAINST) -> Summary:
    """Write summary.csv and the figures into sweep_dir: timelines.png, metrics.png,
    tradeoff.png (throughput against latency), latency_cdf.png (per run) and, per swept field,
    by_<field>.png (`against`'s metrics, summary.csv columns). Returns the rows and the skipped."""
    rows, panels, latencies = [], [], {}
    jobs, skipped = _job_dirs(sweep_dir)
    for job in jobs:
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
        if (job / "requests.csv").exists():
            latencies[row["job"]] = _latencies(job / "requests.csv")
    if not rows:
        return Summary(rows, skipped)
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
    ran = [r for r in rows if r["status"] != "failed"]
    if ran:
        plot_tradeoff(
            [label_of[r["job"]] for r in ran], [r["output_throughput_tok_s"] for r in ran],
            {k: [r[f"{k}.p50"] for r in ran] for k in LATENCY}, sweep_dir / "tradeoff.png",
        )  # fmt: skip
    if latencies:
        plot_cdfs({label_of[j]: v for j, v in latencies.items()}, sweep_dir / "latency_cdf.png")
    for field, lines in swept_lines(ran, against).items():
        plot_against(field, lines, sweep_dir / f"by_{field}.png")
    return Summary(rows, skipped)


def _latencies(requests_csv: Path) -> dict[str, np.ndarray]:
    """Each finished request's TTFT, TPOT and E2E (seconds) from a run's requests.csv."""
    with requests_csv.open() as f:
        done = [r for r in csv.DictReader(f) if r["status"] == "finished"]
    return {k: np.array([float(r[k]) if r[k] else np.nan for r in done]) for k in LATENCY}


def _value(v: str):
    try:
        return float(v)
    except ValueError:
        return v


def swept_lines(rows: list[dict], metrics: tuple[str, ...]) -> dict[str, dict]:
    """Per swept field (an override whose value differs between rows): one line per value of
    the other overrides, as plot_against takes them, the field's values in order."""
    overrides = [dict(o.split("=", 1) for o in r["overrides"].split() if "=" in o) for r in rows]
    fields = sorted({k for o in overrides for k in o if len({x.get(k) for x in overrides}) > 1})
    out = {}
    for field in fields:
        lines: dict[str, list] = {}
        for row, o in zip(rows, overrides):
            if field in o:
                rest = " ".join(
                    f"{k}={v}" for k, v in sorted(o.items()) if k in fields and k != field
                )
                lines.setdefault(rest, []).append((_value(o[field]), row))
        out[field] = {}
        for label, pts in lines.items():
            pts.sort(key=lambda p: (isinstance(p[0], str), p[0]))
            ys = {m: [float(r[m] or 0.0) for _, r in pts] for m in metrics}
            out[field][label] = ([x for x, _ in pts], ys)
    return out


class SweepSummary(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        rows, skipped = summarize_sweep(Path(config.hydra.sweep.dir))
        for job, why in skipped:
            print(f"jaxbatch: skipped job {job}: {why}", file=sys.stderr)
        print(f"jaxbatch: {len(rows)} runs summarised in {config.hydra.sweep.dir}/summary.csv")
        failed = [r["job"] for r in rows if r["status"] == "failed"]
        if failed:  # the sweep ran every job, but a script must see that some failed
            print(f"jaxbatch: {len(failed)} of {len(rows)} jobs failed (jobs {', '.join(failed)}): "
                  "see the error column of summary.csv", file=sys.stderr)  # fmt: skip
            sys.exit(1)
