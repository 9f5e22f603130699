"""A pass's time from its work, for hardware and model sizes this machine lacks.

A pass is priced as the sum over its operations of max(FLOPs / (peak x compute efficiency),
bytes / (bandwidth x memory efficiency)) (attention's rates further scaled by its own efficiency),
plus a fixed per-pass overhead and, with tensor
parallelism, the all-reduce of each layer's two partial sums. The operations: per layer the QKV,
output and MLP matmuls (every fed token), and attention per request, from its own query and
context lengths (never a batch mean); then the LM head on the sampled rows. Weights are read once
a pass. Everything is jnp on per-slot arrays, so it prices plans inside jitted code and under vmap
as well as on the host. Never touch weights here: a ModelSpec and a Hardware entry are all it reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
from jax import Array

from jaxbatch.model.pass_attention import OWN_BLOCK
from jaxbatch.model.spec import ModelSpec

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    """One accelerator (a tensor-parallel group prices `tp` of them): dense bfloat16 peak, memory
    bandwidth and size, interconnect bandwidth per device, and the efficiencies and per-pass
    overhead that calibration fits (`configs/hardware/`)."""

    name: str
    peak_flops: float  # FLOP/s
    memory_bandwidth: float  # bytes/s
    memory_bytes: float
    link_bandwidth: float  # bytes/s, per device, for the all-reduce
    compute_efficiency: float = 0.7
    memory_efficiency: float = 0.9
    pass_overhead_s: float = 0.0
    attention_efficiency: float = 1.0  # attention's rates as a share of the matmuls'
    # Matmuls priced at the runner's padded shape (its bucket's rows x tokens), as this machine's
    # runner computes them (calibration sets it); False: at the tokens fed.
    padded: bool = False


def _itemsize(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else 4


def matmuls(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """Each matmul of one layer: (weights, activations read and written per token)."""
    d, hd, f = spec.d_model, spec.head_dim, spec.d_mlp
    qkv = hd * (spec.n_heads + 2 * spec.n_kv_heads)
    return {
        "qkv": (d * qkv, d + qkv),
        "out": (spec.n_heads * hd * d, spec.n_heads * hd + d),
        "mlp": (3 * d * f, 2 * d + 3 * f),  # gate and up read d, write 2f; down reads f, writes d
    }


def pass_work(
    spec: ModelSpec, num_tokens: Array, start_pos: Array, sampled: Array, tp: int = 1,
    computed: Array | None = None, flat=False,
):  # fmt: skip
    """FLOPs and bytes of each operation of a pass, per device of a `tp`-way group (activations
    counted as if split `tp` ways).

    num_tokens, start_pos [B]: what each slot feeds and where; sampled [B] bool: the slots whose
    last token is sampled; `computed`: the tokens the matmuls run on, padding included (None: the
    tokens fed). `flat` (with `computed`; a bool, traced or not): a mixed pass as the runner
    computes it, whose rows attend to the pass's own keys in blocks of its `computed` rows
    (`own_keys`, priced as a matmul), not per request. Returns {op: (flops, bytes)}, where
    attention's entries are [B] (one per request and all layers) and the others scalars (all
    layers)."""
    n = jnp.asarray(num_tokens, jnp.float32)
    s = jnp.asarray(start_pos, jnp.float32)
    tokens = n.sum() if computed is None else jnp.asarray(computed, jnp.float32)
    rows = jnp.asarray(sampled, jnp.float32).sum()
    w, a = _itemsize(spec.dtype), _itemsize(spec.dtype)
    kv = _itemsize(spec.kv_dtype if spec.kv_dtype != "auto" else spec.dtype)
    layers, d = spec.n_layers, spec.d_model
    work = {}
    for op, (params, io) in matmuls(spec).items():
        p = params / tp
        work[op] = (layers * 2 * tokens * p, layers * (p * w + tokens * io / tp * a))
    # Attention: a request's n new queries see its s cached keys and the causal part of its own;
    # a padded flat pass computes its own keys' part as the runner does, in blocks of OWN_BLOCK
    # rows, each over every row up to its end: R rows, R (R + block) / 2 row pairs.
    own = jnp.asarray(flat) & (computed is not None)
    pairs = n * s + jnp.where(own, 0.0, n * (n + 1) / 2)
    heads, kv_heads = spec.n_heads / tp, spec.n_kv_heads / tp
    per_pair = layers * 4 * heads * spec.head_dim
    own_pairs = tokens * (tokens + jnp.minimum(tokens, OWN_BLOCK)) / 2
    work["own_keys"] = (jnp.where(own, per_pair * own_pairs, 0.0), jnp.float32(0.0))
    flops = per_pair * pairs
    kv_bytes = layers * 2 * kv_heads * spec.head_dim * kv * (s + n)  # read context, write new
    qo_bytes = layers * 2 * n * heads * spec.head_dim * a
    work["attention"] = (flops, kv_bytes + qo_bytes)
    head = spec.vocab_size * d / tp
    work["lm_head"] = (2 * rows * head, head * w + rows * (d + spec.vocab_size / tp) * a)
    return work


def price(
    spec: ModelSpec, hw: Hardware, num_tokens, start_pos, sampled, tp: int = 1, computed=None,
    flat=False,
) -> Array:  # fmt: skip
    """Seconds for one pass on a `tp`-way tensor-parallel group of `hw` (`computed`, `flat`: see
    `pass_work`; used when `hw.padded`)."""
    compute = hw.peak_flops * hw.compute_efficiency
    memory = hw.memory_bandwidth * hw.memory_efficiency
    total = jnp.float32(hw.pass_overhead_s)
    computed = computed if hw.padded else None
    work = pass_work(spec, num_tokens, start_pos, sampled, tp, computed, flat)
    for op, (flops, nbytes) in work.items():
        scale = hw.attention_efficiency if op == "attention" else 1.0
        total = total + jnp.maximum(flops / compute, nbytes / memory).sum() / scale
    if tp > 1:  # ring all-reduce of the attention and MLP outputs, every layer
        tokens = jnp.asarray(num_tokens, jnp.float32).sum()
        moved = 2 * (tp - 1) / tp * tokens * spec.d_model * _itemsize(spec.dtype)
        total = total + 2 * spec.n_layers * moved / hw.link_bandwidth
    return total


def weight_bytes(spec: ModelSpec) -> int:
    """Every weight of the model (embedding and LM head untied), in its dtype."""
    layer = sum(p for p, _ in matmuls(spec).values()) + 2 * spec.d_model
    return (spec.n_layers * layer + 2 * spec.vocab_size * spec.d_model + spec.d_model) * (
        _itemsize(spec.dtype)
    )


ACTIVATION_RESERVE = 0.1  # the share of each device's memory kept for activations


def kv_budget_tokens(
    spec: ModelSpec, hw: Hardware, tp: int, reserve: float = ACTIVATION_RESERVE
) -> int:
    """KV positions that fit a `tp`-way group once the weights and an activation reserve (a share
    of each device's memory) are placed: negative when the weights alone do not fit."""
    free = tp * (hw.memory_bytes * (1 - reserve)) - weight_bytes(spec)
    return int(free // spec.kv_bytes_per_token)
