"""Ctrl-C and failing jobs, on real `jaxbatch` processes: an interrupted run keeps its outputs
(exit 130), a failing sweep job is recorded and the sweep goes on, an interrupted sweep keeps the
summary of its jobs so far."""

from __future__ import annotations

import csv
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxbatch.report import rebuild as report

ROOT = Path(__file__).parents[1]
MODEL = [
    "model.name=custom", "model.vocab_size=256", "model.d_model=64", "model.n_layers=1",
    "model.n_heads=4", "model.n_kv_heads=2", "model.d_mlp=128",
]  # fmt: skip
# Long enough that no run ends before the signal: 6,000 requests of up to 90 tokens. Prompts of
# one length bucket and a short max_len keep the warm-up (each process's compilations) short.
REQUESTS = 6000
WORKLOAD = [
    f"workload.num_requests={REQUESTS}", "workload.prompt.dist=uniform", "workload.prompt.low=17",
    "workload.prompt.high=32", "workload.output.dist=uniform", "workload.output.low=20",
    "workload.output.high=90",
]  # fmt: skip
COMMON = [
    *MODEL,
    "model.max_len=128",
    *WORKLOAD,
    "engine.num_slots=4",
    "output.plots=true",
]


CACHE: list[str] = []  # the module's compile cache, as an override (`_cache`)


@pytest.fixture(scope="module", autouse=True)
def _cache(tmp_path_factory):
    """One compile cache for the module's processes (what a user's default, `user`, does): a
    process loads the passes an earlier one compiled, where they share them. A resumed run
    keeps its run's config, the cache too."""
    CACHE.append(f"engine.compile_cache={tmp_path_factory.mktemp('xla')}")
    yield
    CACHE.clear()


def _start(args: list[str]) -> subprocess.Popen:
    cache = [] if any(a.startswith("resume=") for a in args) else CACHE
    cmd = [sys.executable, "-m", "jaxbatch", *args, *cache]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for_passes(proc: subprocess.Popen, timeout: float = 240.0) -> bytes:
    """Read the progress bar on stderr until passes are running (past warm-up)."""
    seen, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        ready, _, _ = select.select([proc.stderr], [], [], 0.5)
        if ready:
            seen += os.read(proc.stderr.fileno(), 65536)
            if b"tok/s]" in seen:  # tqdm's rate: a bar that has advanced at least once
                return seen
    raise AssertionError(f"no pass ran within {timeout} s: {seen[-500:]!r}")


def _interrupt(proc: subprocess.Popen) -> tuple[float, str]:
    """SIGINT, then seconds until the process exits, and its remaining stderr."""
    _wait_for_passes(proc)
    time.sleep(0.5)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    return time.monotonic() - t0, err.decode()


def _requests(run: Path) -> list[dict]:
    return list(csv.DictReader((run / "requests.csv").open()))


@pytest.mark.parametrize("loop, backend", [("host", "runner"), ("device", "runner"),
                                           ("device", "simulator")])  # fmt: skip
def test_ctrl_c_keeps_every_output_of_the_passes_done(tmp_path, loop, backend):
    policy = "chunked" if (loop, backend) == ("device", "runner") else "continuous"
    # The simulator runs no model: 6,000 requests of it last several seconds.
    simulated = ["engine.clock=passes"] if backend == "simulator" else []
    args = [f"hydra.run.dir={tmp_path}", *COMMON, f"policy={policy}", f"engine.loop={loop}",
            f"engine.backend={backend}"]  # fmt: skip
    proc = _start(args + simulated)
    seconds, err = _interrupt(proc)
    assert proc.returncode == 130
    assert seconds < 10  # the loop stops within a pass or segment; the rest is writing files
    m = json.loads((tmp_path / "metrics.json").read_text())
    rows = _requests(tmp_path)
    interrupted = [r for r in rows if r["status"] == "interrupted"]
    assert m["interrupted"] is True and m["num_passes"] > 0
    assert len(rows) == REQUESTS and {r["status"] for r in rows} <= {"finished", "interrupted"}
    assert len(interrupted) == REQUESTS - m["num_finished"] > 0
    assert err.strip().splitlines()[-1] == (
        f"jaxbatch: interrupted after {m['num_passes']} passes: {len(interrupted)} requests left "
        f"unfinished (status interrupted); outputs in {tmp_path}"
    )
    passes = list(csv.DictReader((tmp_path / "passes.csv").open()))
    assert len(passes) == m["num_passes"]
    produced = sum(int(r["output_len"]) for r in rows)
    assert produced == m["output_tokens"] > 0
    assert produced < sum(int(r["max_new_tokens"]) for r in rows)
    assert all(int(r["output_len"]) <= int(r["max_new_tokens"]) for r in rows)
    assert all(
        int(r["output_len"]) == int(r["max_new_tokens"]) for r in rows if r["status"] == "finished"
    )
    for name in ("timeline.png", "memory.png", "record.npz"):
        assert (tmp_path / name).stat().st_size > 0
    if loop == "host":  # a checkpoint where it stopped, and the command that continues it
        assert err.strip().splitlines()[-2] == (
            f"jaxbatch: checkpoint of pass {m['num_passes']} in {tmp_path / 'checkpoint'}; "
            f"continue the run with: jaxbatch resume={tmp_path}"
        )
        again = tmp_path / "resumed"
        proc = _start([f"hydra.run.dir={again}", f"resume={tmp_path}"])
        _interrupt(proc)
        resumed = json.loads((again / "metrics.json").read_text())
        assert resumed["resumed_from"] == str(tmp_path)
        assert resumed["num_passes"] > m["num_passes"] and resumed["policy"] == policy
        assert resumed["num_finished"] >= m["num_finished"]


def test_a_failing_sweep_job_is_recorded_and_the_sweep_goes_on(tmp_path, capsys):
    small = [
        *MODEL,
        "model.max_len=256",
        "engine.warmup=false",
        "workload.num_requests=4",
        "output.plots=false",
    ]
    proc = _start(["-m", f"hydra.sweep.dir={tmp_path}", *small, "engine.num_slots=0,2"])
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1
    rows = list(csv.DictReader((tmp_path / "summary.csv").open()))
    assert [(r["job"], r["status"]) for r in rows] == [("0", "failed"), ("1", "finished")]
    assert rows[0]["error"] == "ConfigError: engine.num_slots=0 is not valid: must be > 0"
    assert rows[0]["num_passes"] == "" and int(rows[1]["num_finished"]) == 4
    assert "1 of 2 jobs failed (jobs 0)" in err.decode()
    # jaxbatch-report rebuilds the summary from the job directories alone, and skips a job
    # directory that never ended.
    summary = (tmp_path / "summary.csv").read_bytes()
    for made in (tmp_path / "summary.csv", *tmp_path.glob("*.png")):
        made.unlink()
    (tmp_path / "2" / ".hydra").mkdir(parents=True)
    assert report.main([str(tmp_path)]) == 0
    assert (tmp_path / "summary.csv").read_bytes() == summary
    for name in ("timelines.png", "metrics.png", "tradeoff.png", "latency_cdf.png"):
        assert (tmp_path / name).stat().st_size > 0
    err = capsys.readouterr().err
    assert "skipped 2: no metrics.json or error.json: the job never ended" in err


def test_an_interrupted_sweep_keeps_the_summary_of_its_jobs(tmp_path):
    proc = _start(["-m", f"hydra.sweep.dir={tmp_path}", *COMMON, "engine.num_slots=2,3"])
    _, err = _interrupt(proc)
    assert proc.returncode == 130
    rows = list(csv.DictReader((tmp_path / "summary.csv").open()))
    assert [(r["job"], r["status"]) for r in rows] == [("0", "interrupted")]
    assert int(rows[0]["num_passes"]) > 0
    assert not (tmp_path / "1").exists()  # the sweep ran no more jobs
    assert err.strip().splitlines()[-1].startswith("jaxbatch: sweep interrupted: 1 runs summarised")
