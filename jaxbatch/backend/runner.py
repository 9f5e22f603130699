"""Real execution of a plan: one jitted, shape-bucketed pass of the Flax model per plan.

Prefill, decode and mixed passes are the same function at different static shapes (rows x tokens,
context read): each row feeds its slot's tokens at their positions, attends to its slot's cached
context and this pass's own tokens, and samples one token from its last position. A host pass
writes its K/V layer by layer; the device loop writes them after the pass (see `kvcache`).
Parameters, cache and the token buffer are explicit arguments; the cache and token buffer are
donated. This module never decides what runs: the plan does.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import Array
from jax.sharding import Mesh

from jaxbatch.backend.buckets import QUERY_TILE, Buckets, PassShape, decode_fits
from jaxbatch.backend.executables import abstract, compiled
from jaxbatch.backend.sharding import cache_sharding, compact_decodes, replicated, shard_params
from jaxbatch.interrupt import never
from jaxbatch.model.kvcache import (
    CacheIndex,
    PagedCache,
    SlotCache,
    init_paged_cache,
    init_slot_cache,
    min_read,
)
from jaxbatch.model.spec import ModelSpec
from jaxbatch.model.transformer import Transformer
from jaxbatch.sched.blocks import MemorySpec
from jaxbatch.sched.state import DECODE, IDLE, MIXED, PREFILL, Plan


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy. A request's draws depend only on (seed, request id, position)."""

    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0


def sample(logits: Array, req: Array, pos: Array, sampling: Sampling) -> Array:
    """logits [R, V], req [R], pos [R] (the position of the token being drawn) -> tokens [R]."""
    if sampling.temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / sampling.temperature
    if sampling.top_k > 0:
        kth = jax.lax.top_k(scaled, sampling.top_k)[0][:, -1:]
        scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    base = jax.random.PRNGKey(sampling.seed)

    def draw(row_logits, r, p):
        key = jax.random.fold_in(jax.random.fold_in(base, r), p)
        return jax.random.categorical(key, row_logits)

    return jax.vmap(draw)(scaled, req, pos).astype(jnp.int32)


@struct.dataclass
class PassOut:
    """What a pass computed, before anything is stored: its rows' K/V per layer (where the index
    says), each row's drawn token and where it goes in the token buffer, each slot's token."""

    ks: tuple[Array, ...]  # per layer [N, T, kv_heads, head_dim]
    vs: tuple[Array, ...]
    index: CacheIndex
    # Per sampled row (every row; a flat pass: each slot's last row, slot s at row s):
    emit_req: Array  # [S] the request a row's drawn token belongs to; out of range: none
    next_pos: Array  # [S] that token's position
    drawn: Array  # [S]
    tokens: Array  # [num_slots] each slot's drawn token, -1 where none
    logits: Array | None  # [num_slots, vocab] with `with_logits`


def forward_rows(
    params, cache, token_buf, prompt_len, request_ids, row_slot, row_req, row_start, row_len,
    row_last, row_table, *, spec: ModelSpec, shape: PassShape, sampling: Sampling, num_slots: int,
    with_logits: bool, write: bool = True,
) -> tuple[SlotCache | PagedCache, PassOut]:  # fmt: skip
    """One forward pass over `shape.rows` rows of `shape.tokens` tokens each. A slot's tokens may
    span several rows (the mixed pass: one token per row); only its last row (`row_last`) samples
    the slot's next token. With `write` the returned cache holds the pass's K/V; without, it is the
    cache as given, only read, and the caller stores `PassOut`'s K/V (`cache.write`)."""
    t = jnp.arange(shape.tokens)
    positions = row_start[:, None] + t
    valid = t < row_len[:, None]
    tokens = token_buf.at[row_req[:, None], positions].get(mode="clip")
    table = row_table if isinstance(cache, PagedCache) else None
    slots = None if shape.all_slots else row_slot
    index = CacheIndex(slots, positions, valid, table, shape.tiles, QUERY_TILE, num_slots)
    sampled = None
    if shape.flat:  # only each slot's last row samples: the LM head runs on slots, not rows
        at = jnp.where(row_last, row_slot, num_slots)
        rows = jnp.arange(shape.rows, dtype=jnp.int32)
        sampled = jnp.zeros(num_slots, jnp.int32).at[at].set(rows, mode="drop")
        row_last = jnp.zeros(num_slots, bool).at[at].set(True, mode="drop")
        row_slot = jnp.arange(num_slots, dtype=jnp.int32)
        row_req, row_start, row_len = (x[sampled] for x in (row_req, row_start, row_len))
    logits, (ks, vs), cache = Transformer(spec).apply(
        {"params": params}, tokens, positions, cache, index, shape.context,
        logit_index=jnp.maximum(row_len - 1, 0), logit_rows=sampled, write=write,
    )  # fmt: skip
    next_pos = row_start + row_len
    drawn = sample(logits, request_ids.at[row_req].get(mode="clip"), next_pos, sampling)
    # Only a row whose known tokens are all cached has drawn a real output token.
    emits = row_last & (row_len > 0) & (next_pos >= prompt_len.at[row_req].get(mode="clip"))
    out_slot = jnp.where(row_last, row_slot, num_slots)
    out_tokens = jnp.full((num_slots,), -1, jnp.int32).at[out_slot].set(drawn, mode="drop")
    out_logits = None
    if with_logits:
        out_logits = jnp.zeros((num_slots, spec.vocab_size), jnp.float32)
        out_logits = out_logits.at[out_slot].set(logits, mode="drop")
    emit_req = jnp.where(emits, row_req, token_buf.shape[0])
    return cache, PassOut(ks, vs, index, emit_req, next_pos, drawn, out_tokens, out_logits)


def store_tokens(token_buf: Array, out: PassOut) -> Array:
    """The token buffer with a pass's emitted tokens written in."""
    return token_buf.at[out.emit_req, out.next_pos].set(out.drawn, mode="drop")


def flatten(plan: Plan, rows: int, num_slots: int):
    """A mixed pass's rows from a plan's per-slot arrays: one row per fed token, slots in order,
    padded to `rows`. Returns the row arguments of `forward_rows` (slot, req, start, len, last,
    table)."""
    req, num_tokens, start_pos, block_table = (
        plan.req, plan.num_tokens, plan.start_pos, plan.block_table
    )  # fmt: skip
    ends = jnp.cumsum(num_tokens)
    first = ends - num_tokens
    r = jnp.arange(rows)
    valid = r < ends[-1]
    slot = jnp.minimum(jnp.searchsorted(ends, r, side="right"), num_slots - 1)
    row_slot = jnp.where(valid, slot, num_slots).astype(jnp.int32)
    row_req = jnp.where(valid, req[slot], 0).astype(jnp.int32)
    row_start = jnp.where(valid, start_pos[slot] + r - first[slot], 0).astype(jnp.int32)
    row_last = valid & (r == ends[slot] - 1)
    return row_slot, row_req, row_start, valid.astype(jnp.int32), row_last, block_table[slot]


def prefill_rows(plan: Plan, rows: int, num_slots: int, xp=np):
    """A prefill pass's rows from a plan's per-slot arrays (numpy on the host, jnp in the device
    loop): the fed slots in slot order, then rows that feed nothing (slot num_slots), `rows` in
    all (at most num_slots). Returns the row arguments of `forward_rows`."""
    fed = plan.num_tokens > 0
    order = xp.argsort(xp.where(fed, 0, num_slots) + xp.arange(num_slots))[:rows]
    valid = fed[order]
    slot = xp.where(valid, order, num_slots).astype(xp.int32)
    req, start, length = (xp.where(valid, x[order], 0).astype(xp.int32)
                          for x in (plan.req, plan.start_pos, plan.num_tokens))  # fmt: skip
    table = xp.where(valid[:, None], plan.block_table[order], -1).astype(xp.int32)
    return slot, req, start, length, length > 0, table


def decode_rows(plan: Plan, shape: PassShape):
    """A decode pass's rows from a plan's per-slot arrays: row i is slot i. A plan the shape does
    not fit (`decode_fits`; the engine may dispatch a pass before its plan reaches the host)
    feeds nothing: the pass then writes no K/V and emits no token."""
    fed = jnp.where(decode_fits(plan, shape), plan.num_tokens, 0).astype(jnp.int32)
    slots = jnp.arange(fed.shape[0], dtype=jnp.int32)
    return slots, plan.req, plan.start_pos, fed, fed > 0, plan.block_table


def compact_rows(plan: Plan, shape: PassShape):
    """A compact decode's rows (`PassShape.compact`) from a plan's per-slot arrays: the fed slots
    in slot order, as a prefill of one token each lays them out. A plan the shape does not fit
    feeds nothing (see `decode_rows`)."""
    fed = jnp.where(decode_fits(plan, shape), plan.num_tokens, 0).astype(jnp.int32)
    return prefill_rows(plan.replace(num_tokens=fed), shape.rows, fed.shape[0], jnp)


def _pass(params, cache, token_buf, prompt_len, request_ids, *rows, **static):
    """A whole pass, writing K/V as it goes. Returns cache, token buffer, slot tokens, logits.
    A flat (mixed) or decode shape takes the plan and lays out its rows from it on the device;
    a prefill shape takes its rows."""
    shape, num_slots = static["shape"], static["num_slots"]
    if shape.flat:
        rows = flatten(*rows, shape.rows, num_slots)
    elif shape.all_slots:
        rows = decode_rows(*rows, shape)
    elif shape.compact:
        rows = compact_rows(*rows, shape)
    cache, out = forward_rows(params, cache, token_buf, prompt_len, request_ids, *rows, **static)
    return cache, store_tokens(token_buf, out), out.tokens, out.logits


# Shapes warm-up compiles (or loads) at once: each compilation holds its own XLA buffers.
WARMUP_THREADS = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2)


@cache
def _jitted_pass(
    spec: ModelSpec, shape: PassShape, sampling: Sampling, num_slots: int, with_logits: bool,
    placement=None,
):  # fmt: skip
    """One jitted function per static configuration, shared by every Runner of the process.
    `placement` (on a mesh): the cache's shardings and the replicated one, which the outputs
    keep, so a pass never hands the next a cache placed differently (a recompilation)."""
    fn = partial(
        _pass, spec=spec, shape=shape, sampling=sampling, num_slots=num_slots,
        with_logits=with_logits,
    )  # fmt: skip
    if placement is None:
        return jax.jit(fn, donate_argnums=(1, 2))
    cache_placed, rep = placement
    out = (cache_placed, rep, rep, rep if with_logits else None)
    return jax.jit(fn, donate_argnums=(1, 2), out_shardings=out)


class Runner:
    """Holds the device state of a real run (parameters, KV cache, token buffer) and runs plans."""

    runs_ahead = True  # the host loop dispatches a decode before it sees its plan (`engine`)

    def __init__(
        self,
        spec: ModelSpec,
        params: dict,
        num_slots: int,
        prompts: np.ndarray,
        prompt_len: np.ndarray,
        request_ids: np.ndarray | None = None,
        sampling: Sampling = Sampling(),
        with_logits: bool = False,
        min_bucket: int = 16,
        memory: MemorySpec | None = None,
        mixed_rows: int = 0,
        mesh: Mesh | None = None,
        compact: bool = True,
    ):
        """With a `mesh`, parameters, cache and buffers are placed on it (`sharding`); the
        passes are the same jitted functions, partitioned by XLA from those placements.
        `compact`: a decode of few slots runs only their rows (`Buckets.decode_width`), except
        on a mesh that splits the slots."""
        self.spec, self.params, self.num_slots, self.mesh = spec, params, num_slots, mesh
        self.sampling, self.with_logits = sampling, with_logits
        self.paged = memory is not None and memory.paged
        read = min_read(spec.max_len, self.paged)
        self.buckets = Buckets(num_slots, spec.max_len, min_bucket, mixed_rows, read,
                               compact=compact_decodes(compact, mesh))  # fmt: skip
        self.max_blocks = memory.max_blocks if memory else 0

        def new_cache() -> SlotCache | PagedCache:
            if self.paged:
                return init_paged_cache(spec, memory.num_blocks, memory.block_size)
            return init_slot_cache(spec, num_slots)

        self.token_buf = jnp.asarray(prompts, jnp.int32)  # [N, max_len]: prompt, then outputs
        self.prompt_len = jnp.asarray(prompt_len, jnp.int32)
        ids = np.arange(len(prompt_len)) if request_ids is None else request_ids
        self.request_ids = jnp.asarray(ids, jnp.int32)  # seeds each request's sampling stream
        self.placement = None
        self._passes = {}  # compiled passes by shape (and row dtypes)
        if mesh is None:
            self.params, self.cache = jax.device_put(params), new_cache()
        else:  # allocated where they live: no device ever holds the whole cache or weights
            self.placement = (cache_sharding(jax.eval_shape(new_cache), mesh), replicated(mesh))
            self.params = shard_params(params, mesh)
            self.cache = jax.jit(new_cache, out_shardings=self.placement[0])()
            self.token_buf, self.prompt_len, self.request_ids = jax.device_put(
                (self.token_buf, self.prompt_len, self.request_ids), replicated(mesh)
            )

    def _call(self, shape: PassShape, *rows) -> tuple[Array, Array | None]:
        """Run the compiled pass of `shape` on its row arguments (see `_pass`)."""
        args = self._args(rows)
        self.cache, self.token_buf, tokens, logits = self._program(shape, args)(*args)
        return tokens, logits

    def _program(self, shape: PassShape, args: tuple):
        """The compiled pass of `shape` for these arguments (see `executables`)."""
        kinds = (shape, *(x.dtype for x in jax.tree.leaves(args[5:])))  # host or device: alike
        fn = self._passes.get(kinds)
        if fn is None:  # parameters and buffers keep their types: only a shape's rows may vary
            static = (self.spec, shape, self.sampling, self.num_slots, self.with_logits)
            jitted = _jitted_pass(*static, self.placement)
            fn = self._passes[kinds] = compiled(jitted, ("runner._pass", *static), args)
        return fn

    def _idle_rows(self, shape: PassShape) -> tuple:
        """Row arguments of a pass of `shape` that feeds nothing."""
        plan = shape.flat or shape.all_slots or shape.compact  # rows laid out from a plan
        n = self.num_slots if plan else shape.rows
        zeros = np.zeros(n, np.int32)
        no_blocks = np.full((n, self.max_blocks), -1, np.int32)
        if plan:  # an empty plan: every slot feeds nothing
            return (Plan(zeros, zeros, zeros, np.int32(IDLE), np.float32(0), no_blocks),)
        idle_slot = np.full(n, self.num_slots, np.int32)
        return idle_slot, zeros, zeros, zeros, zeros > 0, no_blocks

    def warmup(self, shapes: list[PassShape], stop: Callable[[], bool] = never) -> None:
        """Compile (or load) every shape in `shapes`, several at a time, and run each once as
        soon as it is ready, writing nothing; until `stop()`. XLA compiles, and loads compiled
        code, outside Python's lock, so the runs overlap the compilations still going. A run is
        needed: a program's first run does one-time work (XLA's CPU dot library builds its
        pipelines then), which would otherwise fall on the clock."""
        # The buffers' types, not the buffers: the runs donate the cache while others compile.
        buffers = jax.tree.map(abstract, self._buffers())

        def prepare(shape):
            if not stop():
                self._program(shape, (*buffers, *self._placed(self._idle_rows(shape))))

        with ThreadPoolExecutor(WARMUP_THREADS) as pool:
            ready = [pool.submit(prepare, shape) for shape in shapes]
            try:
                for shape, prepared in zip(shapes, ready):
                    prepared.result()
                    if stop():
                        break
                    self._call(shape, *self._idle_rows(shape))
            finally:
                pool.shutdown(cancel_futures=True)
        jax.block_until_ready(self.cache)

    def _args(self, rows: tuple) -> tuple:
        """A pass's arguments: the device buffers, then its rows."""
        return (*self._buffers(), *self._placed(rows))

    def _buffers(self) -> tuple:
        return self.params, self.cache, self.token_buf, self.prompt_len, self.request_ids

    def _placed(self, rows: tuple) -> tuple:
        if self.mesh is not None:  # every call's rows placed alike: one compilation per shape
            rows = jax.device_put(rows, replicated(self.mesh))
        return rows

    def decode(self, plan: Plan, shape: PassShape) -> tuple[Array, Array | None]:
        """A decode pass of `shape`, straight from a plan's arrays (on the device or not). The
        host need not have seen the plan: if it is not a decode pass that fits `shape`, the pass
        feeds nothing (see `decode_rows`)."""
        return self._call(shape, plan)

    def carry(self) -> tuple:
        """The device buffers a pass reads and writes: the KV cache and the token buffer."""
        return self.cache, self.token_buf

    def keep(self, carry: tuple) -> None:
        self.cache, self.token_buf = carry

    def outputs(self, num_generated: np.ndarray) -> list[np.ndarray]:
        """Each request's output token ids, read back once at the end of a run."""
        buf, plen = np.asarray(self.token_buf), np.asarray(self.prompt_len)
        return [buf[i, plen[i] : plen[i] + g] for i, g in enumerate(num_generated)]

    def execute(
        self, plan: Plan, shape: PassShape, on_device: Plan | None = None
    ) -> tuple[Array, Array | None]:
        """Run a host-side plan at its bucketed shape (`buckets.shape_of(plan)`); returns device
        arrays: each slot's drawn token [B] (and logits). Decode and mixed passes lay out their
        rows on the device from the plan's arrays, so passing the plan's device copy as
        `on_device` saves a host-to-device copy."""
        p = plan if on_device is None else on_device
        if int(plan.kind) == DECODE:
            return self.decode(p, shape)
        if int(plan.kind) == MIXED:  # flattened on the device, as the device loop does
            return self._call(shape, p)
        assert int(plan.kind) == PREFILL, f"the runner has no pass of kind {int(plan.kind)}"
        return self._call(shape, *prefill_rows(plan, shape.rows, self.num_slots))
