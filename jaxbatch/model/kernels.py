"""The fused attention kernels JAX ships for accelerators, behind the portable path's interface.

`model.attention` picks one: `xla` (attention.py's matmuls, every platform), `cudnn`
(`jax.nn.dot_product_attention`'s cuDNN flash attention, GPU), or `pallas` (the Pallas paged
attention kernel of `jax.experimental.pallas.ops.tpu`, TPU). `choose` decides, in this one place,
whether a requested kernel can run here; a kernel that cannot falls back to `xla` with one
message. A kernel's result enters the same softmax merge as the portable partials (attention.py),
so every pass kind keeps its structure and only the arithmetic moves into the kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from jaxbatch.model.attention import MASKED, Partial

ATTENTION = ("xla", "cudnn", "pallas")
# jax.nn.dot_product_attention's implementation for model.attention=cudnn. The tests run the same
# code on the CPU with JAX's own "xla" implementation of that function.
CUDNN_IMPLEMENTATION = "cudnn"


def choose(requested: str, platform: str, dtype: str, paged: bool, devices: int) -> tuple[str, str]:
    """The kernel a run uses, and why it is not the one requested ("" when it is)."""
    why = ""
    if requested == "cudnn":
        if platform != "gpu":
            why = f"cuDNN attention runs on a GPU; this is {platform}"
        elif dtype != "bfloat16":
            why = "cuDNN attention takes bfloat16 inputs: set model.dtype=bfloat16"
    elif requested == "pallas":
        if platform != "tpu":
            why = f"the Pallas paged attention kernel runs on a TPU; this is {platform}"
        elif not paged:
            why = "the Pallas kernel reads a paged KV cache: set memory=paged"
    if not why and requested != "xla" and devices > 1:
        why = "a fused kernel runs on one device here; this mesh has several"
    return ("xla", why) if why else (requested, "")


def fused_partial(q: Array, k: Array, v: Array, visible: Array) -> Partial:
    """attention.partial's result from `jax.nn.dot_product_attention` (cuDNN flash attention),
    same arguments: q [N, T, H, D]; k, v [N, Hkv, C, D] per row or [Hkv, C, D] shared by every
    row; visible [N, T, C]. The kernel returns the normalised output and each query's
    log-sum-exp: as a Partial, out = output, top = log-sum-exp, total = 1, so `merge` weighs it
    exactly as it weighs the portable partials."""
    n, t, h, d = q.shape
    hkv = k.shape[-3]
    if k.ndim == 3:  # shared keys: one sequence of every (row, token) query
        qb, mask = q.reshape(1, n * t, h, d), visible.reshape(1, 1, n * t, -1)
        kb, vb = k.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None]
    else:
        qb, mask = q, visible[:, None]
        kb, vb = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    out, lse = jax.nn.dot_product_attention(
        qb.astype(k.dtype), kb, vb, mask=mask, implementation=CUDNN_IMPLEMENTATION,
        return_residual=True,
    )  # fmt: skip
    g = h // hkv
    seen = visible.any(-1)[:, :, None, None]
    top = jnp.where(seen, lse.reshape(n, t, hkv, g).astype(jnp.float32), MASKED)
    out = out.reshape(n, t, hkv, g, d).astype(jnp.float32)
    return Partial(out, top, jnp.ones_like(top))


def paged_decode(q: Array, k_pool: Array, v_pool: Array, positions: Array, valid: Array,
                 block_table: Array) -> Partial:  # fmt: skip
    """A decode's attention over the paged cache it has written its own K/V into, by the Pallas
    paged attention kernel: q [N, 1, H, D]; pools [Hkv, blocks, block_size, D]; each row sees
    its positions up to its own. The kernel returns only the normalised output, so this is the
    pass's one key set (a Partial with total 1). It reads K/V as bfloat16 (its own cast)."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    n, _, h, d = q.shape
    hkv = k_pool.shape[0]
    pages = block_table.shape[1]
    per_block = max(b for b in (1, 2, 4, 8) if pages % b == 0)
    lengths = jnp.where(valid[:, 0], positions[:, 0] + 1, 0).astype(jnp.int32)
    out = paged_attention(
        (q[:, 0] / jnp.sqrt(d)).astype(jnp.float32), k_pool, v_pool, lengths,
        jnp.maximum(block_table, 0), pages_per_compute_block=per_block,
    )  # fmt: skip
    out = out.reshape(n, 1, hkv, h // hkv, d).astype(jnp.float32)
    top = jnp.where(valid[:, :, None, None], 0.0, MASKED) + jnp.zeros(out.shape[:-1])
    return Partial(out, top, jnp.ones_like(top))
