"""Grouped-query attention as partial results over key sets, merged with one softmax.

A query at position p sees the keys at positions <= p of its own sequence. A pass may attend over
several key sets (the context its slots cached, the keys it computes itself): each set gives a
`Partial` (unnormalised output, running max, sum of weights) and `merge` combines them exactly, as
flash attention combines its key blocks. Keys are head-major, `[rows, kv_heads, keys, head_dim]`,
so every product is a batched matmul XLA runs as one dot on any backend. Never allocate or
schedule here.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array

MASKED = -1e30


def rope_tables(positions: Array, head_dim: int, theta: float, max_len: int) -> tuple[Array, Array]:
    """The rotary embedding's cos and sin [N, T, 1, D/2] at `positions` [N, T], looked up in a
    table of every position below `max_len` (or `T`, a longer uncached sequence from position 0)
    that the pass computes once for all its layers.
    Computed per rotation, XLA fused the cos and sin into each rotation and evaluated them for
    every head of every layer's queries and keys: 4-10% of prefill and mixed passes (measured
    side by side), 1.5 of a 256-row mixed pass's 27 ms of thread time."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    size = max(max_len, positions.shape[1])
    angles = jnp.arange(size, dtype=jnp.float32)[:, None] * inv_freq  # [size, D/2]
    at = jnp.clip(positions, 0, size - 1)
    return jnp.cos(angles)[at][:, :, None, :], jnp.sin(angles)[at][:, :, None, :]


def rope(x: Array, tables: tuple[Array, Array]) -> Array:
    """Rotary position embedding (rotate-half form) of x [N, T, H, D] by `rope_tables`."""
    cos, sin = tables
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class Partial(NamedTuple):
    """Attention of queries [N, T] over one key set, before normalisation."""

    out: Array  # [N, T, Hkv, G, D] sum of exp(score - top) * value
    top: Array  # [N, T, Hkv, G] the largest score seen (MASKED: no key seen)
    total: Array  # [N, T, Hkv, G] sum of exp(score - top)


def partial(q: Array, k: Array, v: Array, visible: Array) -> Partial:
    """q [N, T, H, D]; k, v [N, Hkv, C, D] per row, or [Hkv, C, D] shared by every row;
    visible [N, T, C] bool. Each product is one matmul per KV head whose rows are every query
    (row, token, query head) that reads it: XLA runs that shape near its matmul peak, where
    keeping tokens and heads as separate axes made it pick transposed, slower products."""
    n, t, h, d = q.shape
    hkv = k.shape[-3]
    g = h // hkv
    q5 = q.reshape(n, t, hkv, g, d).astype(jnp.float32)
    k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)
    if k.ndim == 3:  # shared keys: [Hkv, N * T * G queries, D]
        qm = q5.transpose(2, 0, 1, 3, 4).reshape(hkv, n * t * g, d)
        s = jnp.einsum("kmd,kcd->kmc", qm, k32).reshape(hkv, n, t, g, -1)
        seen = visible[None, :, :, None]

        def weigh(w):
            out = jnp.einsum("kmc,kcd->kmd", w.reshape(hkv, n * t * g, -1), v32)
            return out.reshape(hkv, n, t, g, d)

        def to_rows(x):  # [Hkv, N, T, G, ...] -> [N, T, Hkv, G, ...]
            return jnp.moveaxis(x, 0, 2)

    else:  # per-row keys: [N, Hkv, G * T queries, D]
        per_head = _per_query_head(t, g)
        qm = q5.transpose(0, 2, 3, 1, 4).reshape(n, hkv, g * t, d)
        s = _product(qm, k32, "nkmd,nkcd->nkmc", per_head).reshape(n, hkv, g, t, -1)
        seen = visible[:, None, None]

        def weigh(w):
            out = _product(w.reshape(n, hkv, g * t, -1), v32, "nkmc,nkcd->nkmd", per_head)
            return out.reshape(n, hkv, g, t, d)

        def to_rows(x):  # [N, Hkv, G, T, ...] -> [N, T, Hkv, G, ...]
            return jnp.moveaxis(x, 3, 1)

    s = jnp.where(seen, s / jnp.sqrt(d), MASKED)
    top = s.max(-1)
    w = jnp.exp(s - top[..., None])
    return Partial(to_rows(weigh(w)), to_rows(top), to_rows(w.sum(-1)))


def _per_query_head(t: int, g: int) -> bool:
    """The one formulation chosen by platform. On the CPU, rows with one query (decode) and
    several query heads per KV head run their products as one matrix-vector product per query
    head: XLA's CPU dot runs the batched form as a GEMM only G columns wide, several times
    slower (16 slots x 1024 positions, G = 2: a whole decode pass 21.4 ms against 7.2). Elsewhere
    one batched product reads K and V once."""
    return t == 1 and g > 1 and jax.default_backend() == "cpu"


def _product(a: Array, b: Array, spec: str, per_head: bool) -> Array:
    """A per-row product `spec` over [N, Hkv, M, ...] operands, or (per_head) one per M row."""
    if not per_head:
        return jnp.einsum(spec, a, b)
    one = spec.replace("m", "")
    return jnp.stack([jnp.einsum(one, a[:, :, j], b) for j in range(a.shape[2])], 2)


def merge(parts: list[Partial], dtype) -> Array:
    """The attention output [N, T, H, D] over every key set of `parts` (one softmax). A query
    that sees no key at all (padding) gets a finite, meaningless output."""
    top = parts[0].top
    for p in parts[1:]:
        top = jnp.maximum(top, p.top)
    scales = [jnp.exp(p.top - top) for p in parts]
    total = sum(p.total * s for p, s in zip(parts, scales))
    out = sum(p.out * s[..., None] for p, s in zip(parts, scales)) / total[..., None]
    n, t, hkv, g, d = out.shape
    return out.reshape(n, t, hkv * g, d).astype(dtype)


def attend(q: Array, k: Array, v: Array, visible: Array) -> Array:
    """Attention over one key set (see `partial`); k, v [N, T', Hkv, D] as the projections give
    them. Returns [N, T, H, D]."""
    heads_first = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    return merge([partial(q, heads_first(k), heads_first(v), visible)], q.dtype)


def causal(q_pos: Array, kv_pos: Array) -> Array:
    """q_pos [N, T], kv_pos [N, C] -> visible [N, T, C]: keys at or before each query."""
    return kv_pos[:, None, :] <= q_pos[:, :, None]
