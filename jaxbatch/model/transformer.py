"""The Flax decoder-only transformer (Llama-style): RMSNorm, RoPE, SwiGLU, grouped-query attention.

Parameters and the KV cache are explicit arguments: the module holds no state between calls and
knows nothing of scheduling. With no cache it is the uncached reference forward pass.
"""

from __future__ import annotations

from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from jaxbatch.model.attention import attend, causal, rope, rope_tables
from jaxbatch.model.kvcache import CacheIndex, PagedCache, SlotCache
from jaxbatch.model.pass_attention import pass_attention
from jaxbatch.model.spec import ModelSpec

_init = nn.initializers.normal(stddev=0.02)
# Matmuls take `spec.dtype` inputs and accumulate (and return) float32, as accelerators' bfloat16
# matmuls do; the residual stream stays float32. In bfloat16 this does not make tokens independent
# of a request's neighbours (README, "Batch invariance"): XLA's dot sums in an order that depends
# on the row count, and a difference that crosses a bfloat16 rounding step is then 2^-8.
_f32_accumulate = partial(jax.lax.dot_general, preferred_element_type=jnp.float32)


class RMSNorm(nn.Module):
    eps: float

    @nn.compact
    def __call__(self, x: Array) -> Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * scale).astype(x.dtype)


class Block(nn.Module):
    spec: ModelSpec
    layer: int

    @nn.compact
    def __call__(self, x, positions, tables, cache, index, ctx_len, write):
        s, dt = self.spec, self.spec.jnp_dtype

        def dense(features, axis=-1, name=None, bias=False):
            return nn.DenseGeneral(
                features, axis=axis, use_bias=bias, dtype=dt, kernel_init=_init, name=name,
                dot_general=_f32_accumulate,
            )  # fmt: skip

        h = RMSNorm(s.norm_eps, name="attn_norm")(x)
        qkv = partial(dense, bias=s.qkv_bias)
        q = rope(qkv((s.n_heads, s.head_dim), name="q")(h), tables)
        k = rope(qkv((s.n_kv_heads, s.head_dim), name="k")(h), tables)
        v = qkv((s.n_kv_heads, s.head_dim), name="v")(h)
        if cache is None:
            out = attend(q, k, v, causal(positions, positions))
        else:
            if write:  # first: a pass that reads the cache after writing it needs no copy
                cache = cache.write_layer(self.layer, k, v, index)
            out = pass_attention(
                q, k, v, cache, self.layer, index, ctx_len, written=write, attention=s.attention
            )
        x = x + dense(s.d_model, axis=(-2, -1), name="o")(out)
        h = RMSNorm(s.norm_eps, name="mlp_norm")(x)
        gate = nn.silu(dense(s.d_mlp, name="gate")(h))
        x = x + dense(s.d_model, name="down")(gate * dense(s.d_mlp, name="up")(h))
        return x, (k, v), cache


class Transformer(nn.Module):
    """tokens, positions: [N, T]. Returns logits [N, T, V] (or [N, V] at `logit_index` per row;
    only the rows `logit_rows` [S], in that order, where given: [S, ...]),
    this pass's K and V per layer, and the cache: with `write`, updated layer by layer; without,
    as given (the caller writes the K/V later with `cache.write`)."""

    spec: ModelSpec

    @nn.compact
    def __call__(
        self,
        tokens: Array,
        positions: Array,
        cache: SlotCache | PagedCache | None = None,
        index: CacheIndex | None = None,
        ctx_len: int = 0,
        logit_index: Array | None = None,
        logit_rows: Array | None = None,
        write: bool = True,
    ):
        s = self.spec
        x = nn.Embed(s.vocab_size, s.d_model, embedding_init=_init, name="embed")(tokens)
        x = x.astype(jnp.float32)
        tables = rope_tables(positions, s.head_dim, s.rope_theta, s.max_len)
        new_kv = []
        for layer in range(s.n_layers):
            block = Block(s, layer, name=f"layer_{layer}")
            x, kv, cache = block(x, positions, tables, cache, index, ctx_len, write)
            new_kv.append(kv)
        if logit_rows is not None:  # the head runs only on the rows that sample
            x = x[logit_rows]
        x = RMSNorm(s.norm_eps, name="final_norm")(x)
        if logit_index is not None:
            x = jnp.take_along_axis(x, logit_index[:, None, None], axis=1)[:, 0]
        head = nn.Dense(
            s.vocab_size, use_bias=False, dtype=s.jnp_dtype, kernel_init=_init,
            dot_general=_f32_accumulate,
        )  # fmt: skip
        logits = head(x).astype(jnp.float32)
        ks, vs = zip(*new_kv)
        return logits, (ks, vs), cache


def init_params(spec: ModelSpec, seed: int) -> dict:
    """Random weights from a seed, stored as `stored` says, on the default device."""
    return jax.device_put(stored(spec, _initialised(spec, jax.random.PRNGKey(seed))))


@partial(jax.jit, static_argnums=0)
def _initialised(spec: ModelSpec, key: Array) -> dict:
    """Flax's init as one compiled program: run eagerly, its forward pass compiled each of its
    operations apart (about 60 small compilations, 2-3 s, where this takes one)."""
    tokens = jnp.zeros((1, 1), jnp.int32)
    return Transformer(spec).init(key, tokens, tokens)["params"]


def stored(spec: ModelSpec, params: dict) -> dict:
    """Parameters as the runner keeps them, on the host until it places them: matrices
    (embedding, projections, head) in `spec.dtype` (bfloat16 halves their memory), norm scales
    and biases in float32."""

    def cast(path, x):
        small = path[-1].key in ("scale", "bias")
        return np.asarray(x, np.float32 if small else spec.jnp_dtype)

    return jax.tree_util.tree_map_with_path(cast, params)


def full_forward(spec: ModelSpec, params: dict, tokens: Array) -> Array:
    """The uncached reference: logits [N, T, V] for whole sequences starting at position 0."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    logits, _, _ = Transformer(spec).apply({"params": params}, tokens, positions)
    return logits
