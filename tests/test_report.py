"""`jaxbatch-report`'s refusals and how it groups a sweep's runs into lines per swept field (its
rebuild of a sweep's summary is tested on a real sweep in test_interrupt.py)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from matplotlib.colors import to_rgba

from jaxbatch.report import plots
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


def _colour(handle) -> tuple:
    """A legend handle's colour: a scatter's points or a line."""
    scatter = hasattr(handle, "get_offsets")
    return to_rgba(handle.get_facecolor()[0] if scatter else handle.get_color())


@pytest.mark.parametrize("runs", [3, 40])
def test_a_sweeps_figures_keep_their_legend_off_the_data_and_a_colour_per_run(
    tmp_path, monkeypatch, runs
):
    """A 64-run sweep's legend covered its panels and tab10's ten colours repeated: a few runs'
    legend sits in the first panel; many runs' beside the panels, overlapping none, and each run
    has its own colour, and the bars are numbered, not labelled by run."""
    figures = []
    monkeypatch.setattr(plots.plt, "close", figures.append)  # keep each figure to inspect it
    labels = [f"engine.num_slots={i} policy=continuous" for i in range(runs)]
    rng = np.random.default_rng(0)
    latency = {k: list(rng.random(runs)) for k in ("ttft_s", "tpot_s")}
    series = {label: {k: rng.random(6) for k in latency} for label in labels}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # matplotlib's "Tight layout not applied"
        plots.plot_tradeoff(labels, list(rng.random(runs)), latency, tmp_path / "t.png")
        plots.plot_cdfs(series, tmp_path / "c.png")
        plots.plot_bars(labels, {"num_passes": list(range(runs))}, tmp_path / "b.png")
    tradeoff, cdfs, bars = figures
    for fig in (tradeoff, cdfs):
        fig.canvas.draw()
        first = fig.axes[0]
        inside, beside = first.get_legend(), fig.legends
        if runs <= plots.FEW_RUNS:
            assert beside == [] and len(inside.get_texts()) == runs
        else:
            assert inside is None and len(beside) == 1
            assert [t.get_text() for t in beside[0].get_texts()] == labels
            box = beside[0].get_window_extent()
            assert not any(box.overlaps(ax.get_window_extent()) for ax in fig.axes)
        colours = {_colour(h) for h in first.get_legend_handles_labels()[0]}
        assert len(colours) == runs
    ticks = [t.get_text() for t in bars.axes[0].get_xticklabels()]
    assert (ticks == labels) == (runs <= plots.FEW_RUNS)
    assert len({tuple(p.get_facecolor()) for p in bars.axes[0].patches}) == runs
