"""KV memory accounting on arrays: contiguous reservations, or a paged block pool.

`contiguous` reserves a region per request at admission (`max_len`, `pow2` or the `exact` oracle)
and never grows it. `paged` keeps a free-block pool in SchedState and per-slot block tables; blocks
are allocated as a request's tokens grow and freed when it leaves. Everything is jax.numpy and
jittable; nothing here knows how the cache is laid out in device memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
from jax import Array

LAYOUTS = ("contiguous", "paged")
RESERVATIONS = ("max_len", "pow2", "exact")


@dataclass(frozen=True)
class MemorySpec:
    """Static memory shape of a run. budget_tokens: KV positions the budget holds."""

    budget_tokens: int
    max_len: int
    layout: str = "contiguous"
    reservation: str = "max_len"  # contiguous only
    block_size: int = 16  # paged only

    @property
    def paged(self) -> bool:
        return self.layout == "paged"

    @property
    def num_blocks(self) -> int:
        return self.budget_tokens // self.block_size if self.paged else 0

    @property
    def max_blocks(self) -> int:
        """Block-table width: blocks of one max-length sequence (0 for contiguous)."""
        return -(-self.max_len // self.block_size) if self.paged else 0

    @property
    def capacity_tokens(self) -> int:
        """Positions the budget can really hold: whole blocks only, when paged."""
        return self.num_blocks * self.block_size if self.paged else self.budget_tokens

    def need(self, tokens, max_new):
        """KV positions a request must be granted to be admitted: its reservation (contiguous),
        or the blocks of its first `tokens` positions (paged). Works on numpy and jax arrays."""
        if self.paged:
            return -(-tokens // self.block_size) * self.block_size
        total = tokens + max_new
        if self.reservation == "max_len":
            return total * 0 + self.max_len
        if self.reservation == "pow2":
            return jnp.minimum(self.max_len, 2 ** jnp.ceil(jnp.log2(jnp.maximum(total, 1)))).astype(
                jnp.int32
            )
        return total

    def whole_need(self, prompt_len, max_new):
        """KV positions a request needs at its largest: over this budget it can never run."""
        if self.paged:
            return -(-(prompt_len + max_new - 1) // self.block_size) * self.block_size
        return self.need(prompt_len, max_new)


def blocks_for(tokens: Array, block_size: int) -> Array:
    return -(-tokens // block_size)


def allocate(block_table: Array, block_free: Array, target_blocks: Array):
    """Grow each slot's table to target_blocks [B] from the free pool, lowest free ids first.

    The caller guarantees enough free blocks. Returns (block_table, block_free)."""
    b, m = block_table.shape
    have = (block_table >= 0).sum(axis=1)
    grow = jnp.maximum(target_blocks - have, 0)
    offset = jnp.cumsum(grow) - grow  # where each slot's new blocks start in the free list
    n = block_free.shape[0]
    at = jnp.where(block_free, jnp.cumsum(block_free) - 1, n)  # free ids first, ascending
    free_ids = jnp.zeros(n, jnp.int32).at[at].set(jnp.arange(n, dtype=jnp.int32), mode="drop")
    j = jnp.arange(m)[None, :]
    new = (j >= have[:, None]) & (j < (have + grow)[:, None])
    pick = free_ids.at[offset[:, None] + j - have[:, None]].get(mode="clip")
    block_table = jnp.where(new, pick, block_table)
    taken = jnp.where(new, pick, block_free.shape[0])
    block_free = block_free.at[taken.ravel()].set(False, mode="drop")
    return block_table, block_free


def free_slots(block_table: Array, block_free: Array, mask: Array):
    """Return every block of the slots in mask [B] to the pool and clear their tables."""
    owned = jnp.where(mask[:, None] & (block_table >= 0), block_table, block_free.shape[0])
    block_free = block_free.at[owned.ravel()].set(True, mode="drop")
    return jnp.where(mask[:, None], -1, block_table), block_free
