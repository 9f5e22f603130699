"""A host-loop run's checkpoints (orbax), and resuming from one.

A checkpoint holds what the host loop carries from one pass to the next: the scheduler state, the
next plan, the backend's device buffers (the KV cache and the token buffer, `carry()`), the record
so far and the loop's own values (its clock, the pass count, the slots' next positions). Sampling
keys are derived from (seed, request, position), so they need nothing. `output.checkpoint_every=K`
saves one every K passes into the run's `checkpoint/`, and Ctrl-C one where the run stopped: orbax
writes each step into a temporary directory and renames it, so a checkpoint is whole or absent;
the latest KEEP are kept. `resume=DIR` rebuilds the run from the config saved beside them
(`config.yaml`) and continues from the latest: the tokens, plans and per-request pass indices equal
an uninterrupted run's (tests/test_resume.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from omegaconf import OmegaConf

from jaxbatch.config import Config, ConfigError
from jaxbatch.model.kvcache import other_storage

KEEP = 2
CONFIG = "config.yaml"


@dataclass
class Carry:
    """The host loop between two passes."""

    state: object  # SchedState
    plan: object  # Plan, the next pass's
    backend: tuple  # the backend's device buffers (`carry()`)
    record: dict  # the record's columns so far (`Recorder.columns`)
    now: float  # the clock after the last pass
    origin: float  # the device clock's origin (`Clock.origin`)
    passes: int
    ends: np.ndarray  # `engine.next_ends`'s per-slot next positions
    ahead: bool  # whether a decode pass was dispatched ahead on `plan`


def _device_part(carry: Carry):
    return carry.state, carry.plan, carry.backend


class Checkpoints:
    """Saves a run's checkpoints into `path` (one orbax step per save, named by its pass)."""

    def __init__(self, path: Path, every: int, config_yaml: str):
        self.path, self.every, self._config = Path(path).resolve(), every, config_yaml
        self._manager = None  # made at the first save: a run that saves none leaves no folder
        self.last = -1

    def due(self, passes: int) -> bool:
        return self.every > 0 and passes % self.every == 0

    def save(self, carry: Carry) -> None:
        """One checkpoint (a pass count saved already is not saved again). Arrays of size 0 (a
        block table without paged memory) are left out: the rebuilt run has them."""
        if carry.passes == self.last:
            return
        if self._manager is None:
            self.path.mkdir(parents=True, exist_ok=True)
            (self.path / CONFIG).write_text(self._config)
            options = ocp.CheckpointManagerOptions(
                max_to_keep=KEEP, enable_async_checkpointing=False
            )
            self._manager = ocp.CheckpointManager(self.path, options=options)
        leaves = jax.tree.leaves(_device_part(carry))
        tree = {
            "device": {str(i): x for i, x in enumerate(leaves) if np.size(x)},
            "record": {k: np.asarray(v) for k, v in carry.record.items() if np.size(v)},
            "loop": {
                "now": np.float64(carry.now), "origin": np.float64(carry.origin),
                "passes": np.int64(carry.passes), "ends": np.asarray(carry.ends, np.int64),
                "ahead": np.int8(carry.ahead),
            },
        }  # fmt: skip
        self._manager.save(carry.passes, args=ocp.args.StandardSave(tree))
        self._manager.wait_until_finished()
        self.last = carry.passes


def config_of(run_dir: str) -> Config:
    """The config a run was started with, from its checkpoint folder; `resume` set to it."""
    path = Path(run_dir).expanduser() / "checkpoint"
    if latest_step(path) is None or not (path / CONFIG).exists():
        raise ConfigError(
            "resume", run_dir,
            f"no checkpoint in {path} (a host-loop run saves one every output.checkpoint_every "
            "passes, and when Ctrl-C stops it)",
        )  # fmt: skip
    saved = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(path / CONFIG))
    return dataclasses.replace(OmegaConf.to_object(saved), resume=str(run_dir))


def latest_step(path: Path) -> int | None:
    """The pass of the latest whole checkpoint in `path`, None if there is none."""
    if not Path(path).is_dir():
        return None
    return ocp.CheckpointManager(Path(path).resolve()).latest_step()


def _placed_as(value, leaf):
    """A restored array placed as the rebuilt run's own: on its devices if it was committed to
    them (a mesh), else uncommitted, as the arrays the passes were compiled for (a committed
    argument would compile them again), and in its dtype where a KV cache's storage differs."""
    value = np.asarray(value)
    if not isinstance(leaf, jax.Array):
        return value
    if value.dtype == other_storage(leaf.dtype):  # a cache saved on another platform
        value = value.view(leaf.dtype)  # the same bits (`kvcache.storage_dtype`)
    if leaf.committed:
        return jax.device_put(value, leaf.sharding)
    return jnp.asarray(value)


def restore(path: Path, like: Carry) -> Carry:
    """The latest checkpoint in `path`, into the structure (and device placement) of `like`, the
    freshly built run's own carry."""
    path = Path(path).resolve()
    manager = ocp.CheckpointManager(path)
    saved = manager.restore(manager.latest_step())
    leaves, tree = jax.tree.flatten(_device_part(like))
    placed = [_placed_as(saved["device"].get(str(i), leaf), leaf) for i, leaf in enumerate(leaves)]
    state, plan, backend = jax.tree.unflatten(tree, placed)
    loop = saved["loop"]
    return Carry(
        state=state, plan=plan, backend=backend, record=dict(saved.get("record", {})),
        now=float(loop["now"]), origin=float(loop["origin"]), passes=int(loop["passes"]),
        ends=np.asarray(loop["ends"]), ahead=bool(loop["ahead"]),
    )  # fmt: skip
