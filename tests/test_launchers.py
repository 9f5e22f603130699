"""Sweeps that scale out: `hydra/launcher=parallel` (Hydra's joblib launcher, one process per job)
writes what the basic launcher writes, and `hydra/launcher=slurm` (Hydra's submitit launcher)
composes with the repository's configs."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from jaxbatch.cli import CONFIG_DIR
from jaxbatch.config import register

ROOT = Path(__file__).resolve().parents[1]
JOBS = [
    "engine.backend=simulator", "engine.clock=passes", "engine.compile_cache=off",
    "workload.num_requests=40", "output.plots=false", "engine.num_slots=4",
    "policy=static,continuous,chunked",
]  # fmt: skip


def _sweep(out: Path, *args: str) -> str:
    cmd = [sys.executable, "-m", "jaxbatch", "-m", f"hydra.sweep.dir={out}", *JOBS, *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout + proc.stderr


def test_a_parallel_sweep_of_three_jobs_writes_what_the_basic_launcher_writes(tmp_path):
    # Two processes at a time, one of them reused for the third job: this machine has two cores.
    log = _sweep(tmp_path / "parallel", "hydra/launcher=parallel", "hydra.launcher.n_jobs=2")
    assert "Joblib.Parallel(n_jobs=2" in log
    _sweep(tmp_path / "basic")
    rows = {}
    for name in ("parallel", "basic"):
        with (tmp_path / name / "summary.csv").open() as f:
            rows[name] = list(csv.DictReader(f))
    assert [r["status"] for r in rows["parallel"]] == ["finished"] * 3
    vary = {"num_compiles"}  # each process compiles for itself
    for a, b in zip(rows["parallel"], rows["basic"], strict=True):
        assert {k: v for k, v in a.items() if k not in vary} == {
            k: v for k, v in b.items() if k not in vary
        }
    for job in "012":
        for name in ("requests.csv", "passes.csv"):
            parallel = (tmp_path / "parallel" / job / name).read_bytes()
            assert parallel == (tmp_path / "basic" / job / name).read_bytes()


def test_the_slurm_launcher_config_composes():
    register()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.gpus_per_node, launcher.tasks_per_node, launcher.timeout_min) == (1, 1, 60)
