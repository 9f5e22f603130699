"""Attention of one pass's rows over the KV cache and over the keys the pass computes itself.

Rows come in three layouts (see `CacheIndex`): every slot one row of one token (decode), one row
per slot of several tokens (prefill), and flat rows of one token each with a slot's rows
consecutive (the mixed pass of selective batching). A flat pass reads each slot's cached context
once per query tile of consecutive rows (as ragged paged attention kernels do with their query
blocks), never once per row. A pass that wrote its K/V into the cache before attending
(`written`) attends over the cache alone; one that only reads the cache attends over the context
its slots cached before it plus its own keys. Never writes the cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from jaxbatch.model.attention import Partial, causal, merge, partial
from jaxbatch.model.kvcache import CacheIndex, PagedCache, SlotCache


def pass_attention(
    q: Array,
    k: Array,
    v: Array,
    cache: SlotCache | PagedCache,
    layer: int,
    index: CacheIndex,
    ctx_len: int,
    written: bool,
) -> Array:
    """q [N, T, H, D] and this pass's k, v [N, T, Hkv, D] -> [N, T, H, D]. `ctx_len`: cached
    positions read per row (0: none, a pass whose rows all start at position 0)."""
    parts = []
    if ctx_len:
        read = _cached_tiles if index.tiles else _cached_rows
        parts.append(read(q, cache, layer, index, ctx_len, written))
    if not (written and ctx_len):
        parts.append(_own(q, k, v, index))
    return merge(parts, q.dtype)


def _visible(kv_pos: Array, q_pos: Array, first: Array, written: bool) -> Array:
    """[N, T, C]: the cached keys a query sees. Once this pass's K/V are written, the cache holds
    every key up to the query's own; before, only the positions below the first one this pass
    feeds for the slot are valid (the rest of the region may hold stale K/V)."""
    if written:
        return kv_pos[None, None, :] <= q_pos[:, :, None]
    return jnp.broadcast_to(
        kv_pos[None, None, :] < first[:, None, None], (*q_pos.shape, len(kv_pos))
    )


def _cached_rows(q, cache, layer, index: CacheIndex, ctx_len: int, written: bool) -> Partial:
    """Each row is its slot's only row: it reads its slot's context once."""
    k_ctx, v_ctx = cache.read(layer, index, ctx_len)
    seen = _visible(jnp.arange(ctx_len), index.positions, index.positions[:, 0], written)
    return partial(q, k_ctx, v_ctx, seen)


def _cached_tiles(q, cache, layer, index: CacheIndex, ctx_len: int, written: bool) -> Partial:
    """A flat pass: group each slot's consecutive rows into tiles of `index.tile` rows, read the
    context once per tile, and give each row its tile's result."""
    r, size = index.positions.shape[0], index.tile
    rows = jnp.arange(r)
    slot, valid, pos = index.row_slots, index.valid[:, 0], index.positions[:, 0]
    run_starts = valid & ((rows == 0) | (slot != jnp.roll(slot, 1)))
    run_start = jax.lax.cummax(jnp.where(run_starts, rows, 0))  # the slot's first row
    offset = rows - run_start
    tile_starts = valid & (offset % size == 0)
    tile_of = jnp.cumsum(tile_starts) - 1  # each row's tile
    tile_row0 = jnp.full(index.tiles, r, jnp.int32)
    tile_row0 = tile_row0.at[jnp.where(tile_starts, tile_of, index.tiles)].set(rows, mode="drop")
    members = tile_row0[:, None] + jnp.arange(size)  # [tiles, size] row ids
    member_ok = (members < r) & valid.at[members].get(mode="fill", fill_value=False)
    member_ok &= (
        tile_of.at[members].get(mode="fill", fill_value=-1) == jnp.arange(index.tiles)[:, None]
    )
    members = jnp.minimum(members, r - 1)
    head = jnp.minimum(tile_row0, r - 1)
    table = None if index.block_table is None else index.block_table[head]
    tiles = CacheIndex(slots=slot[head], positions=pos[members], valid=member_ok, block_table=table)
    k_ctx, v_ctx = cache.read(layer, tiles, ctx_len)
    first = pos[run_start][head]  # the first position this pass feeds for the tile's slot
    seen = _visible(jnp.arange(ctx_len), tiles.positions, first, written)
    tiled = partial(q[members, 0], k_ctx, v_ctx, seen)  # [tiles, size, ...]
    at = (jnp.maximum(tile_of, 0), offset % size)
    return Partial(*(x[at][:, None] for x in tiled))


def _own(q, k, v, index: CacheIndex) -> Partial:
    """The keys this pass computes: a row's own tokens, or (flat) every row of the same slot,
    each seen by the queries at or after its position."""
    pos, valid = index.positions, index.valid
    if not index.tiles:
        heads_first = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
        return partial(q, heads_first(k), heads_first(v), causal(pos, pos) & valid[:, None, :])
    slots = index.row_slots
    same = (slots[:, None] == slots[None, :]) & valid[None, :, 0]
    seen = same & (pos[None, :, 0] <= pos[:, 0, None])
    shared = lambda x: x[:, 0].transpose(1, 0, 2)  # noqa: E731  [R, 1, Hkv, D] -> [Hkv, R, D]
    return partial(q, shared(k), shared(v), seen[:, None, :])
