"""`jaxbatch-report`'s refusals and how it groups a sweep's runs into lines per swept field (its
rebuild of a sweep's summary is tested on a real sweep in test_interrupt.py)."""

from __future__ import annotations

from jaxbatch.report import rebuild as report
from jaxbatch.report.sweep import swept_lines


def test_a_directory_with_no_runs_fails_with_one_message(tmp_path, capsys):
    (tmp_path / "0" / ".hydra").mkdir(parents=True)  # a job that never ended
    assert report.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "jaxbatch-report: skipped 0: no metrics.json or error.json: the job never ended",
        f"jaxbatch-report: error: no runs in {tmp_path}: no job directory with metrics.json or "
        "error.json (give a multirun's sweep directory, or one run's directory)",
    ]
    assert report.main([str(tmp_path), "--against", "speed"]) == 2
    assert "--against: speed is not a summary.csv column" in capsys.readouterr().err


def test_swept_fields_become_lines_over_the_other_fields():
    rows = [
        {"overrides": f"policy={p} memory.budget_mib={b} output.plots=false", "m": b * k}
        for p, k in (("static", 1), ("continuous", 2)) for b in (16, 4, 8)
    ]  # fmt: skip
    lines = swept_lines(rows, ("m",))
    assert set(lines) == {"memory.budget_mib", "policy"}
    assert lines["memory.budget_mib"] == {
        "policy=continuous": ([4.0, 8.0, 16.0], {"m": [8.0, 16.0, 32.0]}),
        "policy=static": ([4.0, 8.0, 16.0], {"m": [4.0, 8.0, 16.0]}),
    }
    assert lines["policy"]["memory.budget_mib=4"] == (["continuous", "static"], {"m": [8.0, 4.0]})
