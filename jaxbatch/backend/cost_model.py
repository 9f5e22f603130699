"""A pass's time from its work, for hardware and model sizes this machine lacks.

A pass is priced as the sum over its operations of max(FLOPs / (peak x compute efficiency),
bytes / (bandwidth x memory efficiency)) (attention's rates further scaled by its own efficiency;
with an entry's `overlap` below 1, plus the share of the shorter of the two that the longer does
not hide: `op_time`), plus a fixed per-pass overhead (a prefill's and a mixed pass's each their
own, where the hardware entry says so) and, with tensor parallelism, the all-reduce of each
layer's two partial sums. The operations: per layer the QKV, output and MLP matmuls (every fed
token), and attention per request, from its own query and context lengths (never a batch mean);
then the LM head on the sampled rows. Weights are read once a pass. A `padded` entry (this
machine's, fitted by calibration) prices instead what the runner computes: every operation at the
pass's bucketed shape (`runner_shape`). Everything is jnp on per-slot arrays, so it prices plans
inside jitted code and under vmap as well as on the host. Never touch weights here: a ModelSpec
and a Hardware entry are all it reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax.numpy as jnp
from jax import Array

from jaxbatch.backend.buckets import QUERY_TILE, Buckets
from jaxbatch.model.pass_attention import OWN_BLOCK, skips_unseen
from jaxbatch.model.spec import ModelSpec
from jaxbatch.sched.state import DECODE, MIXED, PREFILL, Plan

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
    # Priced at the runner's padded shape (`runner_shape`: matmuls on its bucket's rows x tokens,
    # attention over each row's context bucket), as this machine's runner computes them
    # (calibration sets it); False: the work the tokens need.
    padded: bool = False
    prefill_overhead_s: float = 0.0  # added to a prefill pass's overhead
    mixed_overhead_s: float = 0.0  # added to a mixed pass's overhead
    # The share of an operation's shorter time (compute or memory) that the longer hides: 1, the
    # roofline's max (an accelerator streams while it computes); 0, their sum.
    overlap: float = 1.0


def op_time(compute_s, memory_s, overlap=1.0, xp=jnp):
    """An operation's time from its compute and memory times: the longer, plus the part of the
    shorter it does not hide (`Hardware.overlap`); numpy or jnp (`xp`)."""
    longer = xp.maximum(compute_s, memory_s)
    return longer + (1.0 - overlap) * (compute_s + memory_s - longer)


def _itemsize(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else 4


def _kv_itemsize(spec: ModelSpec) -> int:
    return _itemsize(spec.kv_dtype if spec.kv_dtype != "auto" else spec.dtype)


def matmuls(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """Each matmul of one layer: (weights, activations read and written per token)."""
    d, hd, f = spec.d_model, spec.head_dim, spec.d_mlp
    qkv = hd * (spec.n_heads + 2 * spec.n_kv_heads)
    return {
        "qkv": (d * qkv, d + qkv),
        "out": (spec.n_heads * hd * d, spec.n_heads * hd + d),
        "mlp": (3 * d * f, 2 * d + 3 * f),  # gate and up read d, write 2f; down reads f, writes d
    }


class Padded(NamedTuple):
    """A pass as the runner computes it (`runner_shape`): `rows` x `tokens` per row, the
    `context` positions each row reads, the query `tiles` of a flat (mixed) pass and the
    positions they read (`tile_context`), its `kind` (numbers or traced scalars) and the
    cache's `slots`."""

    rows: Array
    tokens: Array
    context: Array
    tiles: Array
    kind: Array
    slots: int
    tile_context: Array


def runner_shape(buckets: Buckets, plan: Plan, xp=jnp, mixed_rows=None) -> Padded:
    """The runner's shape of a plan, by its own rule (`Buckets.shape_fields`, numpy or jnp)."""
    rows, tokens, context, any_plan = buckets.shape_fields(plan, xp, mixed_rows)
    mixed = plan.kind == MIXED
    tiles = xp.where(mixed, buckets.tiles(rows, any_plan, xp), 0)
    read = buckets.tile_context(plan, context, xp) if skips_unseen() else context
    tile_context = xp.where(mixed, read, 0)
    return Padded(rows, tokens, context, tiles, plan.kind, buckets.num_slots, tile_context)


def pass_work(
    spec: ModelSpec, num_tokens: Array, start_pos: Array, sampled: Array, tp: int = 1,
    padded: Padded | None = None,
):  # fmt: skip
    """FLOPs and bytes of each operation of a pass, per device of a `tp`-way group (activations
    counted as if split `tp` ways).

    num_tokens, start_pos [B]: what each slot feeds and where; sampled [B] bool: the slots whose
    last token is sampled. Without `padded`, the work the tokens need: attention per request from
    its own query and context lengths, as a ragged attention kernel computes it. With `padded`
    (the runner's shape), the work this repository's runner computes: the matmuls on every row
    of its bucket, and attention over each row's whole context bucket (`_padded_attention`).
    Returns {op: (flops, bytes)}, where attention's entries are [B] (one per request and all
    layers; a scalar when padded) and the others scalars (all layers)."""
    n = jnp.asarray(num_tokens, jnp.float32)
    s = jnp.asarray(start_pos, jnp.float32)
    if padded is None:  # the tokens fed; the LM head on the sampled rows
        tokens, rows = n.sum(), jnp.asarray(sampled, jnp.float32).sum()
    else:  # every row of the bucket; the LM head on each row, a mixed pass's on every slot
        bucket_rows = jnp.asarray(padded.rows, jnp.float32)
        tokens = bucket_rows * jnp.asarray(padded.tokens, jnp.float32)
        rows = jnp.where(padded.kind == MIXED, padded.slots, bucket_rows)
    w, a = _itemsize(spec.dtype), _itemsize(spec.dtype)
    layers, d = spec.n_layers, spec.d_model
    work = {}
    for op, (params, io) in matmuls(spec).items():
        p = params / tp
        work[op] = (layers * 2 * tokens * p, layers * (p * w + tokens * io / tp * a))
    heads, kv_heads = spec.n_heads / tp, spec.n_kv_heads / tp
    per_pair = layers * 4 * heads * spec.head_dim  # QK and PV products, every head and layer
    per_key = layers * 2 * kv_heads * spec.head_dim * _kv_itemsize(spec)  # K and V of a position
    per_query = layers * 2 * heads * spec.head_dim * a  # Q read, O written
    if padded is None:
        # A request's n new queries see its s cached keys and the causal part of its own.
        pairs = n * s + n * (n + 1) / 2
        work["attention"] = (per_pair * pairs, per_key * (s + n) + per_query * n)
        work["own_keys"] = (jnp.float32(0.0), jnp.float32(0.0))
    else:
        work.update(_padded_attention(padded, per_pair, per_key, per_query))
    head = spec.vocab_size * d / tp
    work["lm_head"] = (2 * rows * head, head * w + rows * (d + spec.vocab_size / tp) * a)
    return work


def _padded_attention(shape: Padded, per_pair, per_key, per_query) -> dict:
    """Attention as the runner computes it (`model.pass_attention`), every product at its padded
    shape. Decode: each slot's row reads its context bucket C. Prefill: rows x tokens queries,
    each row reading C (its K/V written first), or from position 0 its own tokens' full product.
    Mixed (flat): each slot's last row reads C, and each query tile of QUERY_TILE rows
    (`tiles` of them) the segments its chunks see (`tile_context`); the pass's own keys are
    attended in blocks of OWN_BLOCK rows, each over the rows up to its end: R rows,
    R (R + block) / 2 row pairs, priced as a matmul (`own_keys`).
    """
    r, t, c, tiles, tc = (jnp.asarray(x, jnp.float32) for x in (*shape[:4], shape.tile_context))
    decode, mixed = shape.kind == DECODE, shape.kind == MIXED
    # Positions read from the cache, and (query, key) pairs over them.
    read = jnp.where(mixed, shape.slots * c + tiles * tc, r * c)
    pairs = jnp.where(mixed, shape.slots * c + tiles * QUERY_TILE * tc, r * t * c)
    prefill_own = jnp.where(decode | mixed | (c > 0), 0.0, r * t * t)  # from position 0
    attention = (
        per_pair * (pairs + prefill_own),
        per_key * (read + r * t) + per_query * r * t,  # read contexts, write new K/V
    )
    own = r * (r + jnp.minimum(r, OWN_BLOCK)) / 2
    own_keys = (jnp.where(mixed, per_pair * own, 0.0), jnp.float32(0.0))
    return {"attention": attention, "own_keys": own_keys}


def price(
    spec: ModelSpec, hw: Hardware, num_tokens, start_pos, sampled, tp: int = 1,
    padded: Padded | None = None, kind=None,
) -> Array:  # fmt: skip
    """Seconds for one pass on a `tp`-way tensor-parallel group of `hw` (`padded`: the runner's
    shape, used when `hw.padded`; see `pass_work`). `kind`: the pass's kind, for its kind's
    overhead (None: a decode's)."""
    compute = hw.peak_flops * hw.compute_efficiency
    memory = hw.memory_bandwidth * hw.memory_efficiency
    total = jnp.float32(hw.pass_overhead_s)
    if kind is not None:
        extra = jnp.where(kind == MIXED, hw.mixed_overhead_s, 0.0)
        total = total + jnp.where(kind == PREFILL, hw.prefill_overhead_s, extra)
    work = pass_work(spec, num_tokens, start_pos, sampled, tp, padded if hw.padded else None)
    for op, (flops, nbytes) in work.items():
        scale = hw.attention_efficiency if op == "attention" else 1.0
        total = total + op_time(flops / compute, nbytes / memory, hw.overlap).sum() / scale
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
