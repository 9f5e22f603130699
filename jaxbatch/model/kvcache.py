"""KV cache layouts as pytrees, and how a pass writes and reads them.

The slot layout keeps each layer's positions of every slot in a few segments, each
`[num_slots, kv_heads, segment_len, head_dim]`; the paged layout keeps a pool of
`[kv_heads, num_blocks, block_size, head_dim]` per layer (the layout of JAX's Pallas paged
attention kernel). Both are head-major, so a read
gives each row its keys as `[kv_heads, positions, head_dim]`: attention is then a batched matmul
with no transpose of the context. A pass addresses either layout through a
CacheIndex: each row's slot, token positions, real tokens and (paged) its block table. A pass may
write its K/V layer by layer before attending (the host loop's passes: XLA updates the donated
cache in place) or read the cache only and write everything at its end (the device loop: a
`lax.switch` branch that wrote the cache would make XLA copy all of it every pass). This module
never decides what to write: the scheduler's plan does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax import Array

from jaxbatch.model.spec import ModelSpec

# XLA's CPU backend has no bfloat16 scatter: it converts the whole cache segment a write goes to
# into float32, scatters, and converts it back, on every write. A 16-slot decode of the tiny model
# (4 KV heads, context 256) took 47 ms in bfloat16 against 4.5 ms in float32, nearly all of it
# those conversions; one token per slot written into a [16, 4, 768, 64] bfloat16 segment took
# 1.5 ms against 6 us in uint16 (2026-12-06). So on the CPU a bfloat16 cache holds its values'
# bit patterns as uint16: written in place, and read back as bfloat16 (`values`, a bitcast).
# Other platforms scatter bfloat16 natively and store it as it is. Chosen here only.
_BITS = {jnp.dtype(jnp.bfloat16): jnp.dtype(jnp.uint16)}
_VALUES = {bits: dtype for dtype, bits in _BITS.items()}


def storage_dtype(dtype) -> jnp.dtype:
    """The dtype a cache of `dtype` values is stored in on this platform."""
    dtype = jnp.dtype(dtype)
    return _BITS.get(dtype, dtype) if jax.default_backend() == "cpu" else dtype


def other_storage(dtype) -> jnp.dtype | None:
    """The other platforms' storage of the same cache values (bfloat16 <-> its uint16 bit
    patterns), to restore a cache saved on another platform (`resume`); None for the rest."""
    dtype = jnp.dtype(dtype)
    return _BITS.get(dtype, _VALUES.get(dtype))


def values(stored: Array) -> Array:
    """A cache array as its values (a bitcast of a bit-pattern store; else as it is)."""
    dtype = _VALUES.get(stored.dtype)
    return stored if dtype is None else jax.lax.bitcast_convert_type(stored, dtype)


def _stored(new: Array, stored_dtype) -> Array:
    """New K/V as the cache stores them."""
    dtype = _VALUES.get(jnp.dtype(stored_dtype))
    if dtype is None:
        return new.astype(stored_dtype)
    return jax.lax.bitcast_convert_type(new.astype(dtype), stored_dtype)


def _put(cache, layer: int, scatter, k: Array, v: Array):
    """The cache with one layer's K and V replaced by `scatter(old, new)`; new: [N, T, H, D]."""
    ks, vs = list(cache.k), list(cache.v)
    ks[layer], vs[layer] = scatter(ks[layer], k), scatter(vs[layer], v)
    return cache.replace(k=tuple(ks), v=tuple(vs))


def segment_bounds(max_len: int, first: int = 64, last: int = 256) -> list[int]:
    """[0, first, 2 first, ..., last, max_len]: the slot layout's position segments."""
    bounds = [0, min(first, max_len)]
    while bounds[-1] < min(last, max_len):
        bounds.append(min(2 * bounds[-1], max_len))
    return bounds + ([max_len] if bounds[-1] < max_len else [])


def min_read(max_len: int, paged: bool) -> int:
    """The fewest cached positions a read takes (a context bucket's floor): a paged read gathers
    only the blocks a context needs (no floor); a slot read takes whole segments, so at least the
    first of `segment_bounds`."""
    return 0 if paged else segment_bounds(max_len)[1]


def _write_all(cache, ks: tuple[Array, ...], vs: tuple[Array, ...], index: CacheIndex):
    """Store a pass's K/V of every layer ([N, T, H, D] each) at its rows' positions."""
    for layer, (k, v) in enumerate(zip(ks, vs)):
        cache = cache.write_layer(layer, k, v, index)
    return cache


@struct.dataclass
class CacheIndex:
    """Where the rows of a pass live in the cache. Shapes: rows N, tokens per row T.

    A row holds one slot's tokens. A flat pass (`tiles` > 0) has one token per row and a slot's
    rows consecutive: attention reads each of `num_slots` slots' context once for its last row,
    and once per query tile of `tile` rows for the others (a prompt chunk's)."""

    slots: Array | None  # [N] int32 (a padding row: out of range); None: row i is slot i
    positions: Array  # [N, T] int32; the position of each token in its sequence
    valid: Array  # [N, T] bool; False for padding tokens
    block_table: Array | None = None  # [N, max_blocks] i32 each row's blocks (paged layout)
    tiles: int = struct.field(pytree_node=False, default=0)  # query tiles of a flat pass
    tile: int = struct.field(pytree_node=False, default=0)  # rows per query tile
    num_slots: int = struct.field(pytree_node=False, default=0)  # slots of a flat pass

    @property
    def row_slots(self) -> Array:
        n = self.positions.shape[0]
        return jnp.arange(n, dtype=jnp.int32) if self.slots is None else self.slots


@struct.dataclass
class SlotCache:
    """Per layer, K and V in position segments [0, 64), [64, 128), [128, 256), ... (see
    `segment_bounds`), each [num_slots, kv_heads, segment_len, head_dim]. A pass reading C
    positions takes the whole segments below C as they are: XLA's CPU dot reads only contiguous
    operands, so a prefix slice of one [.., max_len, ..] array was copied first, and that copy
    was half of a decode pass (16 slots x 256 positions, 4 KV heads)."""

    k: tuple[tuple[Array, ...], ...]
    v: tuple[tuple[Array, ...], ...]

    @property
    def num_slots(self) -> int:
        return self.k[0][0].shape[0]

    @property
    def max_len(self) -> int:
        return sum(seg.shape[2] for seg in self.k[0])

    def read(self, layer: int, index: CacheIndex, ctx_len: int) -> list[tuple[Array, Array, int]]:
        """Each row's cached positions of one layer, at least the first ctx_len: a list of
        (K, V [N, H, positions, D], the segment's first position). Every slot in order (decode)
        reads whole segments in place; rows of chosen slots gather only the first ctx_len."""
        out, start = [], 0
        for k, v in zip(self.k[layer], self.v[layer]):
            if start >= ctx_len:
                break
            if index.slots is not None:  # a gather copies anyway: only the positions needed
                end = min(k.shape[2], ctx_len - start)
                k = k.at[index.slots, :, :end].get(mode="clip")
                v = v.at[index.slots, :, :end].get(mode="clip")
            out.append((values(k), values(v), start))
            start += k.shape[2]
        return out

    def write_layer(self, layer: int, k: Array, v: Array, index: CacheIndex) -> SlotCache:
        """Store one layer's K/V of a pass ([N, T, H, D]) at its rows' positions."""
        # Padding tokens go to an out-of-range position and are dropped, never overwriting a slot.
        pos = jnp.where(index.valid, index.positions, self.max_len)
        rows = jnp.broadcast_to(index.row_slots[:, None], pos.shape)

        def scatter(segments, new):
            out, start = [], 0
            for seg in segments:
                n = seg.shape[2]
                at = jnp.where((pos >= start) & (pos < start + n), pos - start, n)
                out.append(seg.at[rows, :, at].set(_stored(new, seg.dtype), mode="drop"))
                start += n
            return tuple(out)

        return _put(self, layer, scatter, k, v)

    write = _write_all


@struct.dataclass
class PagedCache:
    """Per layer K and V of shape [kv_heads, num_blocks, block_size, head_dim] (as the Pallas
    paged attention kernel reads them); a row reaches its positions through its block table
    (position p lives at block_table[p // bs], p % bs)."""

    k: tuple[Array, ...]
    v: tuple[Array, ...]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[2]

    def read(self, layer: int, index: CacheIndex, ctx_len: int) -> list[tuple[Array, Array, int]]:
        """Each row's first ctx_len cached positions of one layer, as one segment:
        [(K, V [N, H, ctx_len, D], 0)]."""
        bs = self.block_size
        n_read = -(-ctx_len // bs)
        blocks = index.block_table[:, :n_read]  # [N, n_read]; past a row's length: masked later

        def gather(layer_cache):
            ctx = values(layer_cache.at[:, blocks].get(mode="clip")).transpose(1, 0, 2, 3, 4)
            n, h, _, _, d = ctx.shape  # [N, H, n_read, bs, D]
            return ctx.reshape(n, h, n_read * bs, d)[:, :, :ctx_len]

        return [(gather(self.k[layer]), gather(self.v[layer]), 0)]

    def write_layer(self, layer: int, k: Array, v: Array, index: CacheIndex) -> PagedCache:
        bs, num_blocks = self.block_size, self.k[0].shape[1]
        table = index.block_table
        logical = jnp.minimum(index.positions // bs, table.shape[1] - 1)
        block = jnp.take_along_axis(table, logical, axis=1)
        # Padding tokens and unallocated entries (-1) go out of range and are dropped.
        block = jnp.where(index.valid & (block >= 0), block, num_blocks)
        offset = index.positions % bs
        return _put(
            self,
            layer,
            lambda old, new: old.at[:, block, offset].set(
                _stored(new.transpose(2, 0, 1, 3), old.dtype), mode="drop"
            ),
            k,
            v,
        )

    write = _write_all


def init_paged_cache(spec: ModelSpec, num_blocks: int, block_size: int) -> PagedCache:
    shape = (spec.n_kv_heads, num_blocks, block_size, spec.head_dim)
    dtype = storage_dtype(spec.kv_jnp_dtype)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(spec.n_layers))
    return PagedCache(k=zeros, v=tuple(jnp.zeros_like(z) for z in zeros))


def init_slot_cache(spec: ModelSpec, num_slots: int) -> SlotCache:
    bounds = segment_bounds(spec.max_len)

    def layer():
        return tuple(
            jnp.zeros(
                (num_slots, spec.n_kv_heads, hi - lo, spec.head_dim),
                storage_dtype(spec.kv_jnp_dtype),
            )
            for lo, hi in zip(bounds, bounds[1:])
        )

    return SlotCache(
        k=tuple(layer() for _ in range(spec.n_layers)),
        v=tuple(layer() for _ in range(spec.n_layers)),
    )
