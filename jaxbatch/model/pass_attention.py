"""Attention of one pass's rows over the KV cache and over the keys the pass computes itself.

Rows come in three layouts (see `CacheIndex`): every slot one row of one token (decode), one row
per slot of several tokens (prefill), and flat rows of one token each with a slot's rows
consecutive (the mixed pass of selective batching). A flat pass reads each slot's cached context
once for the slot's last row, and once per query tile of a prompt chunk's other rows (as ragged
paged attention kernels do with their query blocks), never once per row. A decode or prefill
pass that wrote its K/V into the cache before attending (`written`) attends over the cache alone;
a flat pass, and one that only reads the cache, attends over the context its slots cached before
it plus its own keys. Never writes the cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from jaxbatch.model.attention import MASKED, Partial, causal, merge, partial
from jaxbatch.model.kernels import fused_partial, paged_decode
from jaxbatch.model.kvcache import CacheIndex, PagedCache, SlotCache, values

# A flat pass's rows attend to the pass's own keys in blocks of this many rows, each over the
# rows up to its own block's end: a slot's rows are consecutive and in position order, so no row
# sees a later block's key, and the products above the diagonal are skipped (as flash attention
# skips its masked key blocks). 64-row blocks against one product over every row, side by side
# in one process (15 decodes and a chunk, medians of 25): tiny model, 4 KV heads, 256 rows 17.7
# ms against 19.2, 512 rows 35.2 against 36.4; `small` (medians of 15), 256 rows 89.9 against
# 93.8, 512 rows 177 against 192. 128-row blocks, or at most 4 blocks, gained less. The blocks'
# products have shapes of their own, whose first runs cost warm-up: realistic chunked's repeated
# warm-up 1.75-1.89 s against 1.57-1.96 s with one product (see the README).
OWN_BLOCK = 64


def pass_attention(
    q: Array,
    k: Array,
    v: Array,
    cache: SlotCache | PagedCache,
    layer: int,
    index: CacheIndex,
    ctx_len: int,
    written: bool,
    attention: str = "xla",
) -> Array:
    """q [N, T, H, D] and this pass's k, v [N, T, Hkv, D] -> [N, T, H, D]. `ctx_len`: cached
    positions read per row (0: none, a pass whose rows all start at position 0; a flat pass: at
    least its rows' first positions, see `Buckets.shape_fields`)."""
    decode = index.slots is None and not index.tiles and q.shape[1] == 1
    if attention == "pallas" and written and ctx_len and decode and isinstance(cache, PagedCache):
        k, v = values(cache.k[layer]), values(cache.v[layer])
        return merge([paged_decode(q, k, v, index.positions, index.valid, index.block_table)],
                     q.dtype)  # fmt: skip
    part = fused_partial if attention == "cudnn" else partial
    # A flat pass never reads its own keys back from the cache: its rows attend to them in one
    # product over the pass's rows, and read only the context cached before the pass (its
    # `ctx_len` covers its rows' starts, not their ends). Read back, each query tile of a long
    # chunk gathered the whole context up to the chunk's end, a copy per tile.
    cached = written and not index.tiles
    parts = []
    if ctx_len:
        read = _cached_flat if index.tiles else _cached_rows
        parts += read(q, cache, layer, index, ctx_len, cached, part)
    if not (cached and ctx_len):
        parts.append(_own(q, k, v, index, part))
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


def _read(q, cache, layer, index: CacheIndex, ctx_len: int, first: Array, written: bool, part,
          skip: bool = False):  # fmt: skip
    """The rows' partials over their slots' cached context, one per segment the cache holds it
    in. `first`: per row, the first position this pass feeds for its slot. With `skip`, a
    segment no valid row sees is neither read nor multiplied (`skips_unseen`)."""

    def seen(k, start):
        return _visible(start + jnp.arange(k.shape[2]), index.positions, first, written)

    if not (skip and skips_unseen()):
        return [part(q, k, v, seen(k, start)) for k, v, start in cache.read(layer, index, ctx_len)]

    def segment(i):  # read inside the branch only: a gathered segment is a copy
        k, v, start = cache.read(layer, index, ctx_len)[i]
        return part(q, k, v, seen(k, start))

    # The segments' shapes, traced apart: each segment starts where the one before it ended.
    keys = [k for k, _, _ in jax.eval_shape(lambda: cache.read(layer, index, ctx_len))]
    starts = np.cumsum([0] + [k.shape[2] for k in keys])
    parts = []
    for i, (k, start) in enumerate(zip(keys, starts.tolist())):
        needed = (seen(k, start) & index.valid[:, :, None]).any()
        shapes = jax.eval_shape(lambda i=i: segment(i))
        parts.append(jax.lax.cond(needed, lambda i=i: segment(i), lambda s=shapes: _unseen(s)))
    return parts


def _unseen(shapes: Partial) -> Partial:
    """The partial of a key set no query sees, as `merge` takes it: weight 0 beside any key a
    query does see (its top is MASKED), a finite output where a query sees none."""
    return Partial(jnp.zeros(shapes.out.shape, shapes.out.dtype),
                   jnp.full(shapes.top.shape, MASKED, shapes.top.dtype),
                   jnp.ones(shapes.total.shape, shapes.total.dtype))  # fmt: skip


def skips_unseen() -> bool:
    """Whether a flat pass skips, with a conditional, each cached segment that no row of its
    prompt chunks sees (a first chunk sees none; the decodes in the pass set its context): on the
    CPU and the TPU, which branch on the device. XLA's GPU conditional copies its predicate to
    the host and waits for it (`ConditionalThunk`), a sync in every layer, so there the pass
    reads and masks every segment. A pass of 15 decodes at context 256 and a first chunk, tiny
    model, with and without the skip in one process (medians of 7): a chunk of 497 rows
    0.71-0.72x the time, of 241 rows 0.83-0.84x; a chunk from position 128, which sees two of
    the three segments, 0.85x and 0.94-0.97x. In realistic chunked (64 requests, 16
    slots, prompts 16..128), 43 of 45 mixed passes hold only first chunks: their time 0.85-0.91x
    in three runs, the decodes' unchanged."""
    return jax.default_backend() in ("cpu", "tpu")


def _cached_rows(q, cache, layer, index: CacheIndex, ctx_len: int, written: bool, part):
    """Each row is its slot's only row: it reads its slot's context once."""
    return _read(q, cache, layer, index, ctx_len, index.positions[:, 0], written, part)


def _cached_flat(q, cache, layer, index: CacheIndex, ctx_len: int, written: bool, part):
    """A flat pass. Each slot's last row (a decode's only row, a chunk's last) reads its slot's
    context once, one query per slot as in a decode pass; the slot's other rows (a prompt
    chunk's) read it once per tile of `index.tile` consecutive rows. Each row gets its result."""
    r, size, b = index.positions.shape[0], index.tile, index.num_slots
    rows = jnp.arange(r)
    slot, valid, pos = index.row_slots, index.valid[:, 0], index.positions[:, 0]
    first_row = jnp.full(b, r, jnp.int32).at[slot].min(rows, mode="drop")
    last_row = jnp.full(b, -1, jnp.int32).at[slot].max(rows, mode="drop")
    held = last_row >= 0
    last = jnp.maximum(last_row, 0)
    slot_ok = jnp.minimum(slot, b - 1)
    is_last = valid & (last_row[slot_ok] == rows)
    first_pos = pos[jnp.minimum(first_row, r - 1)]  # the first position this pass feeds per slot

    # Every slot's last row, row s = slot s: the decode pass's layout and read.
    table = None if index.block_table is None else index.block_table[last]
    group = CacheIndex(None, pos[last][:, None], held[:, None], table)
    by_slot = _read(  # [slots, 1, ...]
        q[last], cache, layer, group, ctx_len, first_pos, written, part
    )

    # The other rows, tiled within their slot.
    chunk = valid & ~is_last
    offset = rows - first_row[slot_ok]
    tile_starts = chunk & (offset % size == 0)
    tile_of = jnp.cumsum(tile_starts) - 1
    tile_row0 = jnp.full(index.tiles, r, jnp.int32)
    tile_row0 = tile_row0.at[jnp.where(tile_starts, tile_of, index.tiles)].set(rows, mode="drop")
    members = tile_row0[:, None] + jnp.arange(size)  # [tiles, size] row ids
    in_tile = (
        tile_of.at[members].get(mode="fill", fill_value=-1) == jnp.arange(index.tiles)[:, None]
    )
    member_ok = chunk.at[members].get(mode="fill", fill_value=False) & in_tile
    members = jnp.minimum(members, r - 1)
    head = jnp.minimum(tile_row0, r - 1)
    table = None if index.block_table is None else index.block_table[head]
    tiles = CacheIndex(slot[head], pos[members], member_ok, table)
    first_tiled = first_pos[slot_ok[head]]
    tiled = _read(
        q[members, 0], cache, layer, tiles, ctx_len, first_tiled, written, part, skip=True
    )

    at_tile = (jnp.clip(tile_of, 0, index.tiles - 1), offset % size)
    pick = lambda x, y: jnp.where(  # noqa: E731
        is_last.reshape(-1, *([1] * (x.ndim - 2))), x[slot_ok][:, 0], y[at_tile]
    )[:, None]
    return [
        Partial(*(pick(x, y) for x, y in zip(group_part, tile_part)))
        for group_part, tile_part in zip(by_slot, tiled)
    ]


def _own(q, k, v, index: CacheIndex, part) -> Partial:
    """The keys this pass computes: a row's own tokens, or (flat) every row of the same slot,
    each seen by the queries at or after its position."""
    pos, valid = index.positions, index.valid
    if not index.tiles:
        heads_first = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
        return part(q, heads_first(k), heads_first(v), causal(pos, pos) & valid[:, None, :])
    slots = index.row_slots
    same = (slots[:, None] == slots[None, :]) & valid[None, :, 0]
    seen = same & (pos[None, :, 0] <= pos[:, 0, None])
    shared = lambda x: x[:, 0].transpose(1, 0, 2)  # noqa: E731  [R, 1, Hkv, D] -> [Hkv, R, D]
    k, v, r = shared(k), shared(v), q.shape[0]
    blocks = [  # a block of rows sees no key of a later row: skip the products above the diagonal
        part(q[lo:hi], k[:, :hi], v[:, :hi], seen[lo:hi, None, :hi])
        for lo, hi in ((lo, min(lo + OWN_BLOCK, r)) for lo in range(0, r, OWN_BLOCK))
    ]
    return Partial(*(jnp.concatenate(x, 0) for x in zip(*blocks)))
