"""Grouped-query attention with position masking, over new tokens or a cache's context.

One rule serves every pass: a query at position p sees the keys at positions <= p. Prefill, decode
and (later) prompt chunks differ only in which keys they read. Never allocate or schedule here.
"""

from __future__ import annotations

import jax
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


def attend(q: Array, k: Array, v: Array, q_pos: Array, kv_pos: Array) -> Array:
    """Causal GQA. q: [N, T, H, D]; k, v: [N, C, Hkv, D]; q_pos: [N, T]; kv_pos: [N, C].

    Returns [N, T, H, D]. Keys with kv_pos > q_pos are masked out.
    """
    n, t, h, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(n, t, hkv, h // hkv, d).astype(jnp.float32)
    k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)
    if t == 1:
        # One query per row (decode): a fused multiply-reduce reads K and V once, where a batched
        # dot of these shapes is several times slower on CPU.
        scores = (qg[:, 0][:, None] * k32[:, :, :, None, :]).sum(-1)  # [n, c, k, g]
        scores = scores.transpose(0, 2, 3, 1)[:, :, :, None, :] / jnp.sqrt(d)
    else:
        scores = jnp.einsum("ntkgd,nckd->nkgtc", qg, k32) / jnp.sqrt(d)
    mask = kv_pos[:, None, None, None, :] <= q_pos[:, None, None, :, None]
    probs = jax.nn.softmax(jnp.where(mask, scores, _MASKED), axis=-1)
    if t == 1:
        p_nckg = probs[:, :, :, 0, :].transpose(0, 3, 1, 2)
        out = (p_nckg[..., None] * v32[:, :, :, None, :]).sum(1)[:, None]  # [n, 1, k, g, d]
    else:
        out = jnp.einsum("nkgtc,nckd->ntkgd", probs, v32)
    return out.reshape(n, t, h, d).astype(q.dtype)
