"""Many devices with JAX's own sharding: a mesh of a data axis and a model axis.

Parameters split over the model axis (tensor parallelism: attention heads and KV heads, the
MLP's inner dimension), by one table of rules keyed by parameter path (`PARAM_RULES`); the KV
cache over its KV-head axis, and the slot layout's slots over the data axis; everything else (the
token buffer, the scheduler's arrays) is replicated. The passes are the single-device passes: XLA
partitions them from their inputs' shardings (computation follows data), so nothing here changes
the model code, and the same code runs on GPU and TPU meshes.
"""

from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxbatch.model.kvcache import PagedCache, SlotCache

AXES = ("data", "model")

# Parameter path ("/"-joined) -> its partition; the first rule that matches wins.
PARAM_RULES: tuple[tuple[str, P], ...] = (
    (r"layer_\d+/(q|k|v)/kernel", P(None, "model", None)),  # [d_model, heads, head_dim]
    (r"layer_\d+/(q|k|v)/bias", P("model", None)),  # [heads, head_dim]
    (r"layer_\d+/o/kernel", P("model", None, None)),  # [heads, head_dim, d_model]
    (r"layer_\d+/(gate|up)/kernel", P(None, "model")),  # [d_model, d_mlp]
    (r"layer_\d+/down/kernel", P("model", None)),  # [d_mlp, d_model]
    (r".*", P()),  # embedding, output head, norms: replicated
)


def make_mesh(data: int, model: int) -> Mesh:
    """The first data x model devices as a (data, model) mesh."""
    devices = jax.devices()
    if data * model > len(devices):
        raise ValueError(f"a {data}x{model} mesh needs {data * model} devices; "
                         f"{len(devices)} are visible")  # fmt: skip
    return Mesh(np.array(devices[: data * model]).reshape(data, model), AXES)


def compact_decodes(requested: bool, mesh: Mesh | None = None, data: int = 1) -> bool:
    """Whether a decode of few slots runs only their rows (`Buckets.compact`): where asked,
    unless the data axis (of `mesh`, or `data` devices where there is no mesh: the simulator's
    rule for the runner it stands for) splits the slots, whose rows' K/V fewer rows would gather
    from other devices. One rule for the runner and the simulator."""
    data = data if mesh is None else mesh.shape[AXES[0]]
    return requested and data == 1


def param_spec(path: str) -> P:
    for pattern, spec in PARAM_RULES:
        if re.fullmatch(pattern, path):
            return spec
    raise AssertionError("the last rule matches every path")


def shard_params(params: dict, mesh: Mesh) -> dict:
    """Parameters placed on the mesh by PARAM_RULES."""

    def put(path, x):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        return jax.device_put(x, NamedSharding(mesh, param_spec(name)))

    return jax.tree_util.tree_map_with_path(put, params)


def cache_sharding(cache: SlotCache | PagedCache, mesh: Mesh):
    """KV heads over the model axis: the slot layout's [slots, kv_heads, positions, head_dim]
    arrays also split their slots over the data axis; a paged pool [kv_heads, blocks, block_size,
    head_dim] keeps its blocks (shared by every slot) whole on each data replica."""
    paged = P("model", None, None, None)
    spec = P("data", "model", None, None) if isinstance(cache, SlotCache) else paged
    return jax.tree.map(lambda _: NamedSharding(mesh, spec), cache)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
