"""KV cache layouts as pytrees, and how a pass writes and reads them.

The slot layout keeps one `[num_slots, max_len, kv_heads, head_dim]` region per slot and layer; the
paged layout keeps a pool of `[num_blocks, block_size, kv_heads, head_dim]` blocks per layer. A pass
addresses either through a CacheIndex: each row's slot, token positions, real tokens and (paged) its
block table. This module never decides what to write: the scheduler's plan does.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct
from jax import Array

from jaxbatch.model.spec import ModelSpec


def _put(layers: tuple[Array, ...], layer: int, value: Array) -> tuple[Array, ...]:
    return layers[:layer] + (value,) + layers[layer + 1 :]


@struct.dataclass
class CacheIndex:
    """Where the rows of a pass live in the cache. Shapes: rows N, tokens per row T."""

    slots: Array | None  # [N] int32 (a padding row: out of range); None: row i is slot i
    positions: Array  # [N, T] int32; the position of each token in its sequence
    valid: Array  # [N, T] bool; False for padding tokens
    block_table: Array | None = None  # [N, max_blocks] i32 each row's blocks (paged layout)


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
        slots = jnp.arange(pos.shape[0]) if index.slots is None else index.slots
        rows = jnp.broadcast_to(slots[:, None], pos.shape)
        k_layer = self.k[layer].at[rows, pos].set(k_new.astype(self.k[layer].dtype), mode="drop")
        v_layer = self.v[layer].at[rows, pos].set(v_new.astype(self.v[layer].dtype), mode="drop")
        if index.slots is None:  # every slot in order (decode): a slice XLA can fuse, no gather
            k_ctx, v_ctx = k_layer[:, :ctx_len], v_layer[:, :ctx_len]
        else:
            k_ctx = k_layer.at[index.slots, :ctx_len].get(mode="clip")
            v_ctx = v_layer.at[index.slots, :ctx_len].get(mode="clip")
        cache = self.replace(k=_put(self.k, layer, k_layer), v=_put(self.v, layer, v_layer))
        return cache, k_ctx, v_ctx


@struct.dataclass
class PagedCache:
    """Per layer K and V of shape [num_blocks, block_size, kv_heads, head_dim]; a row reaches its
    positions through its block table (position p lives at block_table[p // bs], p % bs)."""

    k: tuple[Array, ...]
    v: tuple[Array, ...]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[1]

    def update_and_read(
        self, layer: int, k_new: Array, v_new: Array, index: CacheIndex, ctx_len: int
    ) -> tuple[PagedCache, Array, Array]:
        bs, num_blocks = self.block_size, self.k[0].shape[0]
        table = index.block_table
        logical = index.positions // bs
        block = jnp.take_along_axis(table, jnp.minimum(logical, table.shape[1] - 1), axis=1)
        # Padding tokens and unallocated entries (-1) go out of range and are dropped.
        block = jnp.where(index.valid & (block >= 0), block, num_blocks)
        offset = index.positions % bs
        k_layer = (
            self.k[layer].at[block, offset].set(k_new.astype(self.k[layer].dtype), mode="drop")
        )
        v_layer = (
            self.v[layer].at[block, offset].set(v_new.astype(self.v[layer].dtype), mode="drop")
        )
        n_read = -(-ctx_len // bs)
        blocks = table[:, :n_read]  # [N, n_read]; beyond a row's length they are masked anyway

        def gather(layer_cache):
            ctx = layer_cache.at[blocks].get(mode="clip")  # [N, n_read, bs, H, D]
            return ctx.reshape(ctx.shape[0], n_read * bs, *ctx.shape[3:])[:, :ctx_len]

        cache = self.replace(k=_put(self.k, layer, k_layer), v=_put(self.v, layer, v_layer))
        return cache, gather(k_layer), gather(v_layer)


def init_paged_cache(spec: ModelSpec, num_blocks: int, block_size: int) -> PagedCache:
    shape = (num_blocks, block_size, spec.n_kv_heads, spec.head_dim)
    zeros = tuple(jnp.zeros(shape, spec.jnp_dtype) for _ in range(spec.n_layers))
    return PagedCache(k=zeros, v=tuple(jnp.zeros_like(z) for z in zeros))


def init_slot_cache(spec: ModelSpec, num_slots: int) -> SlotCache:
    shape = (num_slots, spec.max_len, spec.n_kv_heads, spec.head_dim)
    zeros = tuple(jnp.zeros(shape, spec.jnp_dtype) for _ in range(spec.n_layers))
    return SlotCache(k=zeros, v=tuple(jnp.zeros_like(z) for z in zeros))
