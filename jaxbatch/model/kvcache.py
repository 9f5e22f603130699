"""KV cache layouts as pytrees, and how a pass writes and reads them.

The slot layout keeps one contiguous `[num_slots, max_len, kv_heads, head_dim]` region per slot and
layer. A pass addresses the cache through a CacheIndex: which slot each row of the pass belongs to,
the position of each of its tokens, and which tokens are real (padding writes are dropped).
This module must never decide *what* to write: that is the scheduler's plan, turned into an index
by the runner.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct
from jax import Array

from jaxbatch.model.spec import ModelSpec


@struct.dataclass
class CacheIndex:
    """Where the rows of a pass live in the cache. Shapes: rows N, tokens per row T."""

    slots: Array  # [N] int32; a padding row holds an out-of-range slot
    positions: Array  # [N, T] int32; the position of each token in its sequence
    valid: Array  # [N, T] bool; False for padding tokens


@struct.dataclass
class SlotCache:
    """Per layer K and V of shape [num_slots, max_len, kv_heads, head_dim]."""

    k: tuple[Array, ...]
    v: tuple[Array, ...]

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    def update_and_read(
        self, layer: int, k_new: Array, v_new: Array, index: CacheIndex, ctx_len: int
    ) -> tuple[SlotCache, Array, Array]:
        """Write this pass's K/V of one layer, then read each row's first ctx_len positions."""
        # Padding tokens go to an out-of-range position and are dropped, never overwriting a slot.
        pos = jnp.where(index.valid, index.positions, self.max_len)
        rows = jnp.broadcast_to(index.slots[:, None], pos.shape)
        k_layer = self.k[layer].at[rows, pos].set(k_new.astype(self.k[layer].dtype), mode="drop")
        v_layer = self.v[layer].at[rows, pos].set(v_new.astype(self.v[layer].dtype), mode="drop")
        k_ctx = k_layer.at[index.slots, :ctx_len].get(mode="clip")
        v_ctx = v_layer.at[index.slots, :ctx_len].get(mode="clip")
        cache = SlotCache(
            k=self.k[:layer] + (k_layer,) + self.k[layer + 1 :],
            v=self.v[:layer] + (v_layer,) + self.v[layer + 1 :],
        )
        return cache, k_ctx, v_ctx


def init_slot_cache(spec: ModelSpec, num_slots: int) -> SlotCache:
    shape = (num_slots, spec.max_len, spec.n_kv_heads, spec.head_dim)
    zeros = tuple(jnp.zeros(shape, spec.jnp_dtype) for _ in range(spec.n_layers))
    return SlotCache(k=zeros, v=tuple(jnp.zeros_like(z) for z in zeros))
