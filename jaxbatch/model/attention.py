"""Grouped-query attention with position masking, over one or several sets of keys.

One rule serves every pass: a query at position p sees the keys at positions <= p of its own
sequence. A cached pass attends over two sets with one softmax: the context its slot cached in
earlier passes (read-only) and the keys this pass computes itself. Never allocate or schedule here.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array

_MASKED = -1e30


def rope(x: Array, positions: Array, theta: float) -> Array:
    """Rotary position embedding (rotate-half form). x: [N, T, H, D], positions: [N, T]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [N, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _scores(qg: Array, k: Array) -> Array:
    """qg [N, T, Hkv, G, D], k [N, C, Hkv, D] (or [C, Hkv, D], shared by every row: one dense
    matmul) -> scores [N, Hkv, G, T, C]."""
    k32 = k.astype(jnp.float32)
    if k.ndim == 3:
        return jnp.einsum("ntkgd,ckd->nkgtc", qg, k32)
    if qg.shape[1] == 1:
        # One query per row (decode): a fused multiply-reduce reads K once, where a batched dot
        # of these shapes is several times slower on CPU.
        s = (qg[:, 0][:, None] * k32[:, :, :, None, :]).sum(-1)  # [N, C, Hkv, G]
        return s.transpose(0, 2, 3, 1)[:, :, :, None, :]
    return jnp.einsum("ntkgd,nckd->nkgtc", qg, k32)


def _weighted(p: Array, v: Array) -> Array:
    """p [N, Hkv, G, T, C], v [N, C, Hkv, D] (or shared [C, Hkv, D]) -> [N, T, Hkv, G, D]."""
    v32 = v.astype(jnp.float32)
    if v.ndim == 3:
        return jnp.einsum("nkgtc,ckd->ntkgd", p, v32)
    if p.shape[3] == 1:
        p_ncg = p[:, :, :, 0, :].transpose(0, 3, 1, 2)  # [N, C, Hkv, G]
        return (p_ncg[..., None] * v32[:, :, :, None, :]).sum(1)[:, None]
    return jnp.einsum("nkgtc,nckd->ntkgd", p, v32)


def attend(q: Array, parts: list[tuple[Array, Array, Array]]) -> Array:
    """Causal GQA over key sets sharing one softmax. q: [N, T, H, D]; each part is
    (k, v, visible [N, T, C] bool) with k, v [N, C, Hkv, D] per row or [C, Hkv, D] shared by
    every row. Returns [N, T, H, D].

    A row that sees no key at all (padding) gets a finite, meaningless output."""
    n, t, h, d = q.shape
    hkv = parts[0][0].shape[-2]
    qg = q.reshape(n, t, hkv, h // hkv, d).astype(jnp.float32)
    scores = [
        jnp.where(seen[:, None, None], _scores(qg, k) / jnp.sqrt(d), _MASKED)
        for k, _, seen in parts
    ]
    top = scores[0].max(-1, keepdims=True)
    for s in scores[1:]:
        top = jnp.maximum(top, s.max(-1, keepdims=True))
    weights = [jnp.exp(s - top) for s in scores]
    total = sum(w.sum(-1, keepdims=True) for w in weights)
    out = sum(_weighted(w / total, v) for w, (_, v, _) in zip(weights, parts))
    return out.reshape(n, t, h, d).astype(q.dtype)


def causal(q_pos: Array, kv_pos: Array) -> Array:
    """q_pos [N, T], kv_pos [N, C] -> visible [N, T, C]: keys at or before each query."""
    return kv_pos[:, None, :] <= q_pos[:, :, None]
