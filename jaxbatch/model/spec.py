"""Model dimensions without weights, shared by the runner and (later) the cost model.

A ModelSpec must never hold arrays: it is hashable and used as a static argument of jitted code.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclass(frozen=True)
class ModelSpec:
    vocab_size: int = 2048
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    d_mlp: int = 688
    max_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dtype: str = "float32"  # weights and matmul inputs (accumulation, residual stream: float32)
    kv_dtype: str = "auto"  # the KV cache's; auto: dtype's
    head_size: int = 0  # per attention head; 0: d_model // n_heads
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    tie_embeddings: bool = False  # the output head is the embedding's transpose
    attention: str = "xla"  # the attention kernel (model/kernels.py); xla: the portable matmuls

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_heads

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]

    @property
    def kv_jnp_dtype(self):
        return DTYPES[self.dtype if self.kv_dtype == "auto" else self.kv_dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V that one token position occupies across all layers."""
        itemsize = jnp.dtype(self.kv_jnp_dtype).itemsize
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * itemsize

    @property
    def num_params(self) -> int:
        d, hd = self.d_model, self.head_dim
        attn = d * hd * (self.n_heads * 2 + self.n_kv_heads * 2)
        bias = hd * (self.n_heads + 2 * self.n_kv_heads) if self.qkv_bias else 0
        mlp = 3 * d * self.d_mlp
        per_layer = attn + bias + mlp + 2 * d
        heads = 1 if self.tie_embeddings else 2
        return self.n_layers * per_layer + heads * self.vocab_size * d + d
