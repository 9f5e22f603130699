"""Hugging Face checkpoints of Llama-family models: Llama 2/3, Mistral, Qwen2.

`read_config` turns a local directory's `config.json` into our model fields; `load_params` reads
its `*.safetensors` (one file, or shards with their `model.safetensors.index.json`) into the
Transformer's parameter tree. Every tensor's name and layout is mapped in one table, `_TABLE`; a
missing, misshaped or unexpected tensor, or an architecture or option we do not run, stops with
one message naming it. Reads local files only: there is no model hub here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from jaxbatch.model.spec import ModelSpec

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")  # buffers some checkpoints carry


class CheckpointError(ValueError):
    """A checkpoint jaxbatch cannot load, with what is wrong and where."""


def read_config(path: str | Path) -> dict:
    """Our model fields (ModelConfig's names) from `path/config.json`; refuses what the
    Transformer does not compute (another architecture, activation, rope scaling, biases but
    Qwen2's, a sliding window)."""
    file = Path(path).expanduser() / "config.json"
    if not file.is_file():
        raise CheckpointError("it holds no config.json")
    c = json.loads(file.read_text())
    arch = (c.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"config.json names architecture {arch}; supported: {', '.join(ARCHITECTURES)}"
        )
    # RoPE: `rope_theta` (and `rope_scaling`), or since transformers 5 `rope_parameters`.
    rope = c.get("rope_parameters") or {}
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    refuse = {
        "hidden_act": c.get("hidden_act", "silu") != "silu",
        "rope_scaling": c.get("rope_scaling") not in (None, {}),
        "rope_parameters": rope.get("rope_type", "default") != "default",
        "attention_bias": bool(c.get("attention_bias", False)),
        "mlp_bias": bool(c.get("mlp_bias", False)),
        "use_sliding_window": bool(c.get("use_sliding_window", False)),
    }
    for key, bad in refuse.items():
        if bad:
            raise CheckpointError(f"config.json sets {key}={c[key]!r}, which is not supported")
    heads = c["num_attention_heads"]
    eos = c.get("eos_token_id")
    return {
        "vocab_size": c["vocab_size"], "d_model": c["hidden_size"],
        "n_layers": c["num_hidden_layers"], "n_heads": heads,
        "n_kv_heads": c.get("num_key_value_heads") or heads, "d_mlp": c["intermediate_size"],
        "head_dim": c.get("head_dim") or c["hidden_size"] // heads,
        "rope_theta": float(theta),
        "norm_eps": float(c.get("rms_norm_eps", 1e-6)),
        "qkv_bias": arch == "Qwen2ForCausalLM",
        "tie_embeddings": bool(c.get("tie_word_embeddings", False)),
        "max_positions": int(c.get("max_position_embeddings", 0)),
        "sliding_window": int(c.get("sliding_window") or 0),
        "eos_id": int(eos[0] if isinstance(eos, list) else (-1 if eos is None else eos)),
    }  # fmt: skip


def _table(spec: ModelSpec) -> dict[str, tuple[tuple[str, ...], tuple[int, ...], bool]]:
    """Every tensor of a checkpoint: HF name -> (our parameter path, HF shape, transposed).
    A transposed matrix is [out, in] in the checkpoint, [in, out...] here (then reshaped)."""
    d, hd, h, kv, f = spec.d_model, spec.head_dim, spec.n_heads, spec.n_kv_heads, spec.d_mlp
    table = {
        "model.embed_tokens.weight": (("embed", "embedding"), (spec.vocab_size, d), False),
        "model.norm.weight": (("final_norm", "scale"), (d,), False),
    }
    if not spec.tie_embeddings:
        table["lm_head.weight"] = (("Dense_0", "kernel"), (spec.vocab_size, d), True)
    for i in range(spec.n_layers):
        hf, ours = f"model.layers.{i}.", f"layer_{i}"
        table |= {
            hf + "input_layernorm.weight": ((ours, "attn_norm", "scale"), (d,), False),
            hf + "post_attention_layernorm.weight": ((ours, "mlp_norm", "scale"), (d,), False),
            hf + "self_attn.q_proj.weight": ((ours, "q", "kernel"), (h * hd, d), True),
            hf + "self_attn.k_proj.weight": ((ours, "k", "kernel"), (kv * hd, d), True),
            hf + "self_attn.v_proj.weight": ((ours, "v", "kernel"), (kv * hd, d), True),
            hf + "self_attn.o_proj.weight": ((ours, "o", "kernel"), (d, h * hd), True),
            hf + "mlp.gate_proj.weight": ((ours, "gate", "kernel"), (f, d), True),
            hf + "mlp.up_proj.weight": ((ours, "up", "kernel"), (f, d), True),
            hf + "mlp.down_proj.weight": ((ours, "down", "kernel"), (d, f), True),
        }  # fmt: skip
        if spec.qkv_bias:
            for name, heads in (("q", h), ("k", kv), ("v", kv)):
                table[hf + f"self_attn.{name}_proj.bias"] = ((ours, name, "bias"), (heads * hd,),
                                                            False)  # fmt: skip
    return table


def _our_shape(path: tuple[str, ...], spec: ModelSpec, shape: tuple[int, ...]) -> tuple:
    """The Transformer's layout of a (transposed) checkpoint tensor: attention projections
    split their head axis; everything else keeps its shape."""
    hd, h, kv, d = spec.head_dim, spec.n_heads, spec.n_kv_heads, spec.d_model
    name = path[-2] if len(path) > 2 else ""
    if name in ("q", "k", "v"):
        heads = h if name == "q" else kv
        return (d, heads, hd) if path[-1] == "kernel" else (heads, hd)
    if name == "o":
        return (h, hd, d)
    return shape


def _tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of the directory's safetensors files, as numpy (float32 for bfloat16)."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise CheckpointError("it holds no *.safetensors files")
    out = {}
    for name in files:
        if not (path / name).is_file():
            raise CheckpointError(f"{index.name} names {name}, which is missing")
        with safe_open(str(path / name), framework="flax") as f:
            for key in f.keys():
                out[key] = np.asarray(f.get_tensor(key), np.float32)
    return out


def load_params(path: str | Path, spec: ModelSpec) -> dict:
    """The Transformer's parameters from a checkpoint directory, by `_table`, as float32 numpy
    (`transformer.stored` casts them to the spec's dtype). A tied head is the embedding's
    transpose."""
    path = Path(path).expanduser()
    tensors = {k: v for k, v in _tensors(path).items() if not _IGNORED.match(k)}
    table = _table(spec)
    missing = sorted(set(table) - set(tensors))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"tensor {missing[0]} is missing{more}")
    extra = sorted(set(tensors) - set(table))
    if extra:
        raise CheckpointError(f"tensor {extra[0]} is not one the architecture's table maps "
                              "(an unsupported variant)")  # fmt: skip
    params: dict = {}
    for key, (where, shape, transposed) in table.items():
        x = tensors[key]
        if x.shape != shape:
            raise CheckpointError(f"tensor {key} has shape {x.shape}, config.json implies "
                                  f"{shape}")  # fmt: skip
        x = x.T if transposed else x
        node = params
        for part in where[:-1]:
            node = node.setdefault(part, {})
        node[where[-1]] = np.ascontiguousarray(x.reshape(_our_shape(where, spec, x.shape)))
    if spec.tie_embeddings:
        params["Dense_0"] = {"kernel": np.ascontiguousarray(params["embed"]["embedding"].T)}
    return params
