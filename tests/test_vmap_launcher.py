"""`hydra/launcher=vmap`: a multirun whose simulated jobs run as one program writes what the basic
launcher writes, file for file; jobs that cannot join run alone, and a bad one fails alone."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIMULATED = [
    "engine.backend=simulator", "engine.loop=device", "engine.clock=passes",
    "engine.compile_cache=off", "workload.arrival=poisson", "workload.num_requests=60",
    "engine.num_slots=4", "output.plots=false",
]  # fmt: skip


def _sweep(tmp: Path, name: str, *args: str) -> tuple[Path, str]:
    out = tmp / name
    cmd = [sys.executable, "-m", "jaxbatch", "-m", f"hydra.sweep.dir={out}", *SIMULATED, *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    return out, proc.stdout + proc.stderr


def _rows(sweep: Path) -> list[dict]:
    return list(csv.DictReader((sweep / "summary.csv").open()))


SWEEP = [
    "policy.name=chunked", "memory.layout=paged", "memory.block_size=16",
    "workload.rate=0.02,1", "policy.token_budget=16,256", "memory.budget_tokens=640,1024",
]  # fmt: skip


def test_a_vmapped_sweep_writes_what_the_basic_launcher_writes(tmp_path):
    """Arrival rates (requests per pass, the passes clock) x token budgets (two row buckets) x
    paged memory budgets: one program."""
    sweep = SWEEP
    basic, _ = _sweep(tmp_path, "basic", *sweep)
    vmap, log = _sweep(tmp_path, "vmap", *sweep, "hydra/launcher=vmap")
    jobs = [str(j) for j in range(len(_rows(basic)))]
    assert f"Ran jobs {list(range(len(jobs)))} as one program" in log
    for job in jobs:
        for name in ("passes.csv", "requests.csv"):
            assert (vmap / job / name).read_bytes() == (basic / job / name).read_bytes(), name
    vary = {"num_compiles", "compile_cache_hits"}  # the program compiles once for all three
    for a, b in zip(_rows(basic), _rows(vmap), strict=True):
        assert {k: v for k, v in a.items() if k not in vary} == {
            k: v for k, v in b.items() if k not in vary
        }
    walls = {json.loads((vmap / j / "metrics.json").read_text())["wall_s"] for j in jobs}
    assert len(walls) == 1  # one program: its wall time is each member's
    assert len({r["num_passes"] for r in _rows(vmap)}) >= 3  # different runs


def test_jobs_that_cannot_join_run_alone_and_a_bad_one_fails_alone(tmp_path):
    # Different slot counts make different programs; num_slots=0 is refused.
    vmap, log = _sweep(tmp_path, "vmap", "engine.num_slots=0,3,5", "hydra/launcher=vmap")
    assert "as one program" not in log
    rows = _rows(vmap)
    assert [r["status"] for r in rows] == ["failed", "finished", "finished"]
    assert rows[0]["error"] == "ConfigError: engine.num_slots=0 is not valid: must be > 0"
    assert int(rows[1]["num_finished"]) == int(rows[2]["num_finished"]) == 60
