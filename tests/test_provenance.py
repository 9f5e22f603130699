"""Each run's output directory says what ran: its resolved config (config.yaml, which loads back
into the same Config), the package versions, JAX's backend and devices and the git revision
(provenance.json); metrics.json names them."""

from __future__ import annotations

import json
import subprocess
from importlib.metadata import version
from pathlib import Path

import jax
from omegaconf import OmegaConf

from jaxbatch.cli import execute
from jaxbatch.config import Config
from jaxbatch.report.provenance import PACKAGES
from tests.conftest import make_config

ROOT = Path(__file__).resolve().parents[1]


def test_a_run_records_its_config_versions_devices_and_revision(tmp_path):
    cfg = make_config("chunked", backend="simulator", clock="passes")
    cfg.policy.token_budget = 48
    metrics = execute(cfg, tmp_path)
    ran_on = json.loads((tmp_path / "provenance.json").read_text())
    assert json.loads((tmp_path / "metrics.json").read_text())["provenance"] == ran_on
    assert metrics["config"] == "config.yaml"
    assert ran_on["versions"] == {name: version(name) for name in PACKAGES}
    assert ran_on["jax_backend"] == jax.default_backend()
    assert ran_on["devices"] == [str(d) for d in jax.devices()]
    assert "policy_module" not in ran_on  # the package's own policy: its code is the revision's
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    assert ran_on["git_revision"] in (head, head + "-dirty")
    loaded = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(tmp_path / "config.yaml"))
    assert OmegaConf.to_object(loaded) == cfg
