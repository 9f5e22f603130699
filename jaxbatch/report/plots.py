"""Figures: the slot timeline (rows = slots, columns = passes), stacked timelines, metric bars.

Cells are coloured by request; prefill cells are dark, decode cells light, a slot held by a request
that is not fed (static batching's finished-but-held slots) is grey. Plots read Records only.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from jaxbatch.report.recorder import Record  # noqa: E402
from jaxbatch.sched.state import PREFILL  # noqa: E402

_HELD = np.array([0.78, 0.78, 0.78])
_FREE = np.array([1.0, 1.0, 1.0])


# A timeline image has at most this many columns (passes) and rows (slots): a longer or wider run
# is sampled (nearest pass and slot), so a figure's memory does not grow with passes x slots.
MAX_COLUMNS, MAX_ROWS = 2400, 512


def _sample(n: int, most: int) -> np.ndarray:
    return np.arange(n) if n <= most else np.round(np.linspace(0, n - 1, most)).astype(int)


def timeline_image(record: Record) -> np.ndarray:
    """[rows, columns, 3] RGB: a column per pass, a row per slot (sampled beyond MAX_COLUMNS
    passes or MAX_ROWS slots)."""
    p, b = _sample(record.num_passes, MAX_COLUMNS), _sample(record.num_slots, MAX_ROWS)
    holder, fed = record.holder[p][:, b], record.num_tokens[p][:, b] > 0
    palette = np.array(plt.get_cmap("tab20").colors, np.float32)
    palette = np.delete(palette, [14, 15], axis=0)  # tab20's greys would read as "held, idle"
    colour = palette[np.maximum(holder, 0) % len(palette)]  # [P, B, 3]
    prefill = fed & (record.kind[p] == PREFILL)[:, None]
    img = np.where(prefill[..., None], colour * 0.55, colour * 0.6 + 0.4)
    img = np.where((~fed & (holder >= 0))[..., None], _HELD, img)
    img = np.where((holder < 0)[..., None], _FREE, img)
    return img.transpose(1, 0, 2)


def _shown_slots(record: Record) -> int:
    """A panel's height in slots: a wide run's panel is capped (its rows are sampled anyway)."""
    return min(max(record.num_slots, 1), 48)


def _draw(ax, record: Record, title: str, max_passes: int | None = None) -> None:
    ax.set_ylabel("slot")
    ax.set_title(title, fontsize=10, loc="left")
    if record.num_passes == 0:
        ax.text(0.5, 0.5, "no pass ran: every request was rejected", ha="center", va="center",
                transform=ax.transAxes)  # fmt: skip
        return
    extent = (-0.5, record.num_passes - 0.5, record.num_slots - 0.5, -0.5)
    ax.imshow(timeline_image(record), aspect="auto", interpolation="nearest", extent=extent)
    ax.set_xlim(-0.5, (max_passes or record.num_passes) - 0.5)


_LEGEND = [
    Patch(color=np.array([0.12, 0.47, 0.71]) * 0.55, label="prefill"),
    Patch(color=np.array([0.12, 0.47, 0.71]) * 0.6 + 0.4, label="decode"),
    Patch(color=_HELD, label="held, idle"),
]


def plot_timeline(record: Record, path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.25 * _shown_slots(record)))
    _draw(ax, record, title)
    ax.set_xlabel("pass")
    ax.legend(handles=_LEGEND, loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timelines(panels: list[tuple[str, Record]], path: Path) -> None:
    """One panel per run, on one pass axis, so their lengths compare at a glance."""
    longest = max(max(r.num_passes for _, r in panels), 1)
    height = sum(0.9 + 0.22 * _shown_slots(r) for _, r in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 0.8 + height), squeeze=False)
    for ax, (title, rec) in zip(axes[:, 0], panels):
        _draw(ax, rec, f"{title}: {rec.num_passes} passes", longest)
    axes[-1, 0].set_xlabel("pass")
    axes[0, 0].legend(handles=_LEGEND, loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# A panel's legend or axis names at most this many runs. A sweep of more runs gets a colour each
# from a continuous map (tab10 has ten), its legend beside the panels in columns, and its bars
# numbered by their row in summary.csv: inside a panel, 64 runs' labels hid the data.
FEW_RUNS = 10


def run_colors(n: int) -> list:
    """A distinct colour for each of n runs: tab10's up to FEW_RUNS, then evenly along viridis."""
    if n <= FEW_RUNS:
        return list(plt.get_cmap("tab10").colors[:n])
    return [plt.get_cmap("viridis")(i / (n - 1)) for i in range(n)]


def _save_with_legend(fig, ax, n: int, loc: str, path: Path) -> None:
    """Save a figure of n runs' panels (a constrained layout) with their legend: inside the first
    panel for a few runs, beside the panels for many."""
    if n <= FEW_RUNS:
        ax.legend(fontsize=7, loc=loc)
    else:
        fig.legend(*ax.get_legend_handles_labels(), loc="outside right upper", fontsize=6,
                   ncols=-(-n // 24))  # fmt: skip
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_bars(labels: list[str], metrics: dict[str, list[float]], path: Path) -> None:
    """One small bar chart per metric, one bar per run (numbered by their row in summary.csv
    beyond FEW_RUNS runs)."""
    n = len(labels)
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.2 * len(metrics), 3.2), squeeze=False,
                             layout="constrained")  # fmt: skip
    for ax, (name, values) in zip(axes[0], metrics.items()):
        ax.bar(range(len(values)), values, color=run_colors(len(values)))
        if n <= FEW_RUNS:
            ax.set_xticks(range(n), labels, rotation=30, ha="right", fontsize=8)
        else:
            ax.set_xlabel("run (its row in summary.csv)", fontsize=8)
        ax.set_title(name, fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_memory(record: Record, capacity: int, path: Path, title: str) -> None:
    """KV positions granted and live per pass, against the budget."""
    fig, ax = plt.subplots(figsize=(12, 3))
    x = np.arange(record.num_passes)
    ax.fill_between(x, record.kv_reserved, step="post", alpha=0.35, label="granted")
    ax.fill_between(x, record.kv_tokens, step="post", alpha=0.8, label="live tokens")
    ax.axhline(capacity, color="black", lw=1, ls="--", label="budget")
    ax.set_xlabel("pass")
    ax.set_ylabel("KV positions")
    ax.set_title(f"KV memory ({title})", fontsize=10, loc="left")
    if record.num_passes == 0:
        ax.text(0.5, 0.5, "no pass ran: every request was rejected", ha="center", va="center",
                transform=ax.transAxes)  # fmt: skip
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_tradeoff(labels: list[str], throughput: list[float], latency: dict[str, list[float]],
                  path: Path) -> None:  # fmt: skip
    """Throughput against latency: one panel per latency metric, one point per run."""
    fig, axes = plt.subplots(1, len(latency), figsize=(4 * len(latency), 3.4), squeeze=False,
                             layout="constrained")  # fmt: skip
    colors = run_colors(len(labels))
    for ax, (name, values) in zip(axes[0], latency.items()):
        for label, x, y, color in zip(labels, values, throughput, colors):
            ax.scatter(x, y, color=color, label=label, s=24)
        ax.set_xlabel(f"{name} (s)")
        ax.set_ylabel("output tok/s")
    _save_with_legend(fig, axes[0, 0], len(labels), "best", path)


def plot_cdfs(series: dict[str, dict[str, np.ndarray]], path: Path) -> None:
    """Empirical CDFs of per-request latencies: one panel per metric, one line per run."""
    metrics = list(next(iter(series.values())))
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.4), squeeze=False,
                             layout="constrained")  # fmt: skip
    colors = run_colors(len(series))
    for ax, metric in zip(axes[0], metrics):
        for (label, values), color in zip(series.items(), colors):
            x = np.sort(values[metric][np.isfinite(values[metric])])
            if len(x):
                ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", label=label,
                        color=color)  # fmt: skip
        ax.set_xlabel(f"{metric} (s)")
        ax.set_ylabel("share of requests")
    _save_with_legend(fig, axes[0, 0], len(series), "lower right", path)


def plot_against(field: str, lines: dict[str, tuple[list, dict[str, list[float]]]],
                 path: Path) -> None:  # fmt: skip
    """Metrics against one swept field: one panel per metric, one line per value of the other
    swept fields (`lines`: label -> (the field's values, metric -> values))."""
    metrics = list(next(iter(lines.values()))[1])
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.4), squeeze=False,
                             layout="constrained")  # fmt: skip
    colors = run_colors(len(lines))
    for ax, metric in zip(axes[0], metrics):
        for (label, (xs, ys)), color in zip(lines.items(), colors):
            ax.plot(xs, ys[metric], marker="o", label=label or None, color=color)
        ax.set_xlabel(field)
        ax.set_title(metric, fontsize=9)
    if any(lines):
        _save_with_legend(fig, axes[0, 0], len(lines), "best", path)
    else:
        fig.savefig(path, dpi=110)
        plt.close(fig)
