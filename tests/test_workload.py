"""Synthetic workloads and trace replay, against the real Azure traces in ../shared/traces."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jaxbatch.config import LengthConfig, WorkloadConfig
from jaxbatch.workload import Workload, from_config, read_trace

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


def test_trace_replay_of_the_azure_code_trace():
    arrival, prompt, output = read_trace(TRACES / "azure_llm_2023_code.csv", limit=4)
    # The first four rows of the file, times relative to the first row.
    np.testing.assert_allclose(arrival, [0.0, 0.052, 0.098189, 0.140684], atol=1e-6)
    np.testing.assert_array_equal(prompt, [4808, 3180, 110, 7433])
    np.testing.assert_array_equal(output, [10, 8, 27, 14])
    scaled = read_trace(TRACES / "azure_llm_2023_code.csv", 4, time_scale=0.5, length_scale=0.1)
    np.testing.assert_allclose(scaled[0], arrival * 0.5)
    np.testing.assert_array_equal(scaled[1], [481, 318, 11, 743])
    np.testing.assert_array_equal(scaled[2], [1, 1, 3, 1])
    full = read_trace(TRACES / "azure_llm_2023_conv.csv")
    assert len(full[0]) == 19366  # the README's row count
    assert (np.diff(full[0]) >= 0).all()


def test_trace_workload_from_config_resolves_relative_paths():
    cfg = WorkloadConfig(kind="trace", path="traces/azure_llm_2023_conv.csv", limit=5)
    w = from_config(cfg, base_dir=TRACES.parent)
    assert len(w) == 5
    np.testing.assert_array_equal(w.prompt_len[:4], [374, 396, 879, 91])
    np.testing.assert_array_equal(w.max_new[:4], [44, 109, 55, 16])


@pytest.mark.parametrize("dist", ["fixed", "uniform", "lognormal"])
def test_synthetic_lengths_are_seeded_and_bounded(dist):
    cfg = WorkloadConfig(
        num_requests=2000, arrival="poisson", rate=50.0,
        prompt=LengthConfig(dist=dist, mean=100, low=10, high=300, sigma=0.8), seed=7,
    )  # fmt: skip
    a, b = from_config(cfg), from_config(cfg)
    np.testing.assert_array_equal(a.prompt_len, b.prompt_len)
    assert a.prompt_len.min() >= (100 if dist == "fixed" else 10)
    assert a.prompt_len.max() <= (100 if dist == "fixed" else 300)
    if dist == "uniform":
        assert abs(a.prompt_len.mean() - 155) < 5
    # Poisson at 50/s: mean gap 0.02 s within 5%.
    assert abs(np.diff(a.arrival).mean() - 0.02) < 0.001


def test_gamma_burstiness_keeps_the_rate_and_raises_the_variance():
    base = dict(num_requests=4000, rate=20.0, seed=1)
    smooth = from_config(WorkloadConfig(arrival="gamma", burstiness=4.0, **base)).arrival
    bursty = from_config(WorkloadConfig(arrival="gamma", burstiness=0.25, **base)).arrival
    for a in (smooth, bursty):
        assert abs(np.diff(a).mean() - 0.05) < 0.005
    # Coefficient of variation of a gamma with shape k is 1/sqrt(k).
    cv = lambda a: np.diff(a).std() / np.diff(a).mean()  # noqa: E731
    assert abs(cv(smooth) - 0.5) < 0.05 and abs(cv(bursty) - 2.0) < 0.2


def test_prompts_depend_only_on_seed_and_id():
    cfg = WorkloadConfig(num_requests=6, prompt=LengthConfig(dist="uniform", low=3, high=20))
    w = from_config(cfg)
    full = w.prompts(100, 32)
    sub = w.subset([4, 1]).prompts(100, 32)
    np.testing.assert_array_equal(sub, full[[4, 1]])
    assert (full[np.arange(32)[None, :] >= w.prompt_len[:, None]] == 0).all()


def test_a_text_workloads_subset_keeps_each_prompts_tokens():
    tokens = (np.array([1, 2]), np.array([3, 4]), np.array([5, 6, 7]))
    w = Workload(arrival=np.zeros(3), prompt_len=np.array([2, 2, 3]), max_new=np.ones(3, int),
                 tokens=tokens)  # fmt: skip
    np.testing.assert_array_equal(w.subset([2, 0]).prompts(10, 4), [[5, 6, 7, 0], [1, 2, 0, 0]])
    np.testing.assert_array_equal(w.subset(np.array([False, True, True])).prompts(10, 3),
                                  [[3, 4, 0], [5, 6, 7]])  # fmt: skip
