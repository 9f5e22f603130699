"""Parameters saved and restored with orbax: a directory holding `params/` (an orbax checkpoint of
the parameter pytree, exact in its dtypes) and `model.json` (the dimensions it was trained with,
and what trained it). `jaxbatch-train` writes one; `model.checkpoint=DIR` loads it."""

from __future__ import annotations

import json
from pathlib import Path

import orbax.checkpoint as ocp

from jaxbatch.model.spec import ModelSpec

# The dimensions a checkpoint must share with the config that loads it.
SHAPE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_mlp",
                "head_size", "qkv_bias", "tie_embeddings", "rope_theta", "norm_eps")  # fmt: skip


class TrainedCheckpointError(ValueError):
    """A checkpoint directory that is missing, unreadable or of other dimensions."""


def save_trained(path: str | Path, params: dict, spec: ModelSpec, info: dict) -> None:
    """Write params (orbax) and model.json (the spec's dimensions, `info`) into `path`; orbax
    writes into a temporary directory and renames it, so a checkpoint is whole or absent."""
    path = Path(path).resolve()
    path.mkdir(parents=True, exist_ok=True)
    saver = ocp.StandardCheckpointer()
    saver.save(path / "params", params, force=True)
    saver.wait_until_finished()
    model = {k: getattr(spec, k) for k in SHAPE_FIELDS}
    (path / "model.json").write_text(json.dumps({"model": model, **info}, indent=1) + "\n")


def load_trained(path: str | Path, spec: ModelSpec) -> dict:
    """The parameters saved in `path`, refused with the first dimension that differs from
    `spec`'s."""
    path = Path(path).expanduser().resolve()
    if not (path / "model.json").exists() or not (path / "params").is_dir():
        raise TrainedCheckpointError(
            f"no model.json and params/ in {path} (jaxbatch-train writes them)"
        )
    saved = json.loads((path / "model.json").read_text())["model"]
    for k in SHAPE_FIELDS:
        if saved[k] != getattr(spec, k):
            raise TrainedCheckpointError(
                f"its model.json has {k}={saved[k]}, the config {getattr(spec, k)}"
            )
    return ocp.StandardCheckpointer().restore(path / "params")
