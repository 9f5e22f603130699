"""What a run ran on: package versions, JAX's backend and devices, jaxbatch's git revision, and
the file of a policy of one's own.

`cli` writes it to the run's `provenance.json` (beside its resolved `config.yaml`) and names it in
metrics.json, so a figure can be traced to the code and machine that made it.
"""

from __future__ import annotations

import hashlib
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import jax

from jaxbatch.config import policy_file

PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "hydra-core", "numpy",
            "safetensors")  # fmt: skip
_SOURCE = Path(__file__).resolve().parents[2]  # the checkout jaxbatch runs from


def git_revision(where: Path = _SOURCE) -> str:
    """The checkout's commit, `-dirty` if a tracked file differs from it; 'unknown' outside a
    git checkout (an installed wheel)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()  # fmt: skip

    try:
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def provenance(policy_module: str = "") -> dict:
    """What the run ran on; with a `policy.module` (a policy of one's own, whose code is not
    jaxbatch's), also the file it loaded and its SHA-256, so the run can be traced to it."""

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    ran_on = {
        "git_revision": git_revision(),
        "python": platform.python_version(),
        "versions": {name: installed(name) for name in PACKAGES},
        "jax_backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
    }
    if policy_module:
        path = policy_file(policy_module)
        readable = path is not None and path.is_file()
        ran_on["policy_module"] = {
            "name": policy_module,
            "file": str(path.resolve()) if readable else None,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest() if readable else None,
        }
    return ran_on
