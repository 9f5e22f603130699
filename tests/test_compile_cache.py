"""The persistent compilation cache: a repeated run loads every shape the first one compiled."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TINY = [
    "model.vocab_size=256", "model.d_model=64", "model.n_layers=1", "model.n_heads=2",
    "model.n_kv_heads=1", "model.d_mlp=128", "model.max_len=128", "workload.num_requests=6",
    "workload.prompt.dist=uniform", "workload.prompt.low=4", "workload.prompt.high=40",
    "workload.output.dist=uniform", "workload.output.low=1", "workload.output.high=20",
    "engine.num_slots=2", "output.plots=false", "output.progress=false", "output.tokens=true",
]  # fmt: skip


def _run(out: Path, cache: Path) -> dict:
    cmd = [sys.executable, "-m", "jaxbatch", *TINY, f"engine.compile_cache={cache}",
           f"hydra.run.dir={out}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stderr
    return json.loads((out / "metrics.json").read_text())


def test_second_run_compiles_nothing_and_loads_what_the_first_compiled(tmp_path):
    cache = tmp_path / "cache"
    first = _run(tmp_path / "first", cache)
    second = _run(tmp_path / "second", cache)
    assert first["compile_cache"] == str(cache) and first["compile_cache_hits"] == 0
    assert first["num_compiles"] > 0
    assert second["num_compiles"] == 0
    assert second["compile_cache_hits"] == first["num_compiles"]
    tokens = [(tmp_path / run / "tokens.jsonl").read_text() for run in ("first", "second")]
    assert tokens[0] == tokens[1]
