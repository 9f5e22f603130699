"""The output files of a run: metrics.json, requests.csv, passes.csv, tokens.jsonl, record.npz.

Their columns are the contract that scripts and tests rely on (DESIGN.md, "Outputs of a run").
Nothing here computes a metric: it writes what it is given.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import numpy as np

from jaxbatch.report.metrics import RequestTimes
from jaxbatch.report.recorder import Record
from jaxbatch.sched.state import KIND_NAMES, STATUS_NAMES

REQUEST_COLUMNS = (
    "id", "arrival", "prompt_len", "output_len", "max_new_tokens", "status", "ttft_s", "tpot_s",
    "e2e_s", "preemptions", "reason",
)  # fmt: skip
PASS_COLUMNS = (
    "index", "start", "duration", "kind", "tokens", "computed_tokens", "rows", "row_tokens",
    "context", "active_slots", "kv_live", "kv_granted", "kv_unused", "blocks_granted",
)  # fmt: skip


def _num(x: float) -> str:
    return "" if not np.isfinite(x) else f"{x:.9f}"


def write_metrics(path: Path, metrics: dict) -> None:
    path.write_text(json.dumps(metrics, indent=2) + "\n")


def write_requests(
    path: Path,
    ids: np.ndarray,
    arrival: np.ndarray,
    prompt_len: np.ndarray,
    max_new: np.ndarray,
    status: np.ndarray,
    preemptions: np.ndarray,
    times: RequestTimes,
    reasons: list[str],
) -> None:
    ttft, tpot, e2e = times.ttft(arrival), times.tpot(), times.e2e(arrival)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(REQUEST_COLUMNS)
        for i in range(len(arrival)):
            w.writerow(
                [int(ids[i]), f"{arrival[i]:.9f}", int(prompt_len[i]), int(times.output_len[i]),
                 int(max_new[i]), STATUS_NAMES[int(status[i])], _num(ttft[i]), _num(tpot[i]),
                 _num(e2e[i]), int(preemptions[i]), reasons[i]]
            )  # fmt: skip


def write_passes(path: Path, record: Record, block_size: int) -> None:
    """One row per pass; rows, row_tokens and context: the shape the pass ran at (computed_tokens
    = rows x row_tokens); KV columns count positions after the pass (blocks_granted: paged only,
    else 0). Columns are computed whole, then written row by row."""
    r = record
    blocks = r.kv_reserved // block_size if block_size else np.zeros_like(r.kv_reserved)
    ints = np.stack([
        r.num_tokens.sum(1), r.computed_tokens, r.rows, r.row_tokens, r.context,
        (r.num_tokens > 0).sum(1), r.kv_tokens, r.kv_reserved, r.kv_reserved - r.kv_tokens, blocks,
    ], axis=1).astype(np.int64).tolist() if r.num_passes else []  # fmt: skip
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(PASS_COLUMNS)
        w.writerows(
            [p, f"{r.start[p]:.9f}", f"{r.duration[p]:.9f}", KIND_NAMES[int(r.kind[p])], *ints[p]]
            for p in range(r.num_passes)
        )


def write_tokens(path: Path, outputs: list[np.ndarray], tokenizer=None) -> None:
    """One line per request: its output token ids, and with a tokenizer their text."""
    with path.open("w") as f:
        for i, toks in enumerate(outputs):
            row = {"id": i, "tokens": [int(t) for t in toks]}
            if tokenizer is not None:
                row["text"] = tokenizer.decode(row["tokens"])
            f.write(json.dumps(row) + "\n")


def write_error(path: Path, err: BaseException) -> None:
    """A failed sweep job's error.json: the error's type and message (summary.csv reads it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"error": f"{type(err).__name__}: {err}"}, indent=2) + "\n")


def save_record(path: Path, record: Record) -> None:
    np.savez_compressed(path, **dataclasses.asdict(record))


def load_record(path: Path) -> Record:
    with np.load(path) as data:
        return Record(**{f.name: data[f.name] for f in dataclasses.fields(Record)})
