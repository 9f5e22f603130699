"""Schedule-only runs with many slots: the figures are sampled to a bounded size (a timeline of
100,000 slots once asked matplotlib for a canvas 2.75 million pixels tall), and each sampled cell
is the cell it stands for."""

from __future__ import annotations

import matplotlib.image
import numpy as np

from jaxbatch.cli import execute
from jaxbatch.config import LengthConfig, WorkloadConfig
from jaxbatch.report.plots import MAX_COLUMNS, MAX_ROWS, timeline_image
from jaxbatch.report.recorder import Record
from jaxbatch.sched.state import DECODE
from tests.conftest import make_config


def _record(passes: int, slots: int) -> Record:
    rng = np.random.default_rng(0)
    holder = rng.integers(-1, 50, (passes, slots)).astype(np.int32)
    num_tokens = np.where(holder >= 0, rng.integers(0, 2, (passes, slots)), 0).astype(np.int32)
    z = np.zeros(passes)
    return Record(
        start=z, duration=z + 1, kind=np.full(passes, DECODE), req=np.where(num_tokens, holder, -1),
        num_tokens=num_tokens, start_pos=num_tokens * 0, holder=holder, emits=num_tokens > 0,
        rows=z, row_tokens=z, context=z, kv_tokens=z, kv_reserved=z,
    )  # fmt: skip


def _take(record: Record, p: np.ndarray, b: np.ndarray) -> Record:
    """The record's passes p and slots b only."""
    fields = {}
    for k, v in record.__dict__.items():
        fields[k] = v[p][:, b] if v.ndim == 2 else v[p]
    return Record(**fields)


def test_a_wide_long_timeline_is_sampled_cell_for_cell():
    small = _record(40, 6)
    assert timeline_image(small).shape == (6, 40, 3)  # every cell
    wide = _record(3001, 1500)
    img = timeline_image(wide)
    assert img.shape == (MAX_ROWS, MAX_COLUMNS, 3)
    # Column j shows pass round(j * 3000 / (MAX_COLUMNS - 1)), row i slot round(i * 1499 / 511).
    p = np.round(np.linspace(0, 3000, MAX_COLUMNS)).astype(int)
    b = np.round(np.linspace(0, 1499, MAX_ROWS)).astype(int)
    np.testing.assert_array_equal(img, timeline_image(_take(wide, p, b)))
    np.testing.assert_array_equal(timeline_image(_take(wide, p[:40], b[:6]))[3, 7], img[3, 7])


def test_a_simulated_run_on_thousands_of_slots_writes_bounded_figures(tmp_path):
    cfg = make_config(num_slots=4096, backend="simulator", clock="passes")
    cfg.workload = WorkloadConfig(
        num_requests=300, prompt=LengthConfig(mean=8), output=LengthConfig(dist="uniform", low=1,
                                                                             high=40),
    )  # fmt: skip
    cfg.output.plots = True
    m = execute(cfg, tmp_path)
    assert (
        m["num_finished"] == 300 and m["num_passes"] == 40
    )  # one prefill (the first token), then 39 decodes
    height, width = matplotlib.image.imread(tmp_path / "timeline.png").shape[:2]
    assert (height, width) == (round((1.2 + 0.25 * 48) * 110), 12 * 110)  # 48 slot rows at most
