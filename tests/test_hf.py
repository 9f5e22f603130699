"""Hugging Face checkpoints against the reference implementation: small random Llama and Qwen2
models built and saved by `transformers` (CPU PyTorch), loaded by jaxbatch; logits for prompts of
different lengths equal transformers' (float32, atol 1e-4), and greedy tokens under every policy
and both memory layouts equal transformers' greedy generation. Tied embeddings and a sharded
checkpoint load too; a broken checkpoint is refused with one message naming what is wrong."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
import torch  # test-only dependencies ('.[test]')
import transformers

from jaxbatch.cli import execute
from jaxbatch.config import ConfigError, MemoryConfig, ModelConfig, validate
from jaxbatch.model.transformer import full_forward
from jaxbatch.run import model_params, simulate
from jaxbatch.workload import WorkloadError
from tests.conftest import make_config, make_workload

DIMS = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=112, max_position_embeddings=256,
            rope_theta=5000.0, rms_norm_eps=1e-6)  # fmt: skip
PROMPTS = [5, 17, 1, 30]


def _save(tmp_path, kind: str, tied: bool = False, shard: str | None = None, init=0.02):
    """A random model saved by transformers. Its weights' scale `init`: transformers' default
    0.02 gives near-uniform logits, whose argmax a rounding error can flip; greedy tests use
    larger weights, whose tokens are decided by clear margins."""
    torch.manual_seed(0)
    dims = DIMS | {"initializer_range": init}
    if kind == "llama":
        cfg = transformers.LlamaConfig(**dims, tie_word_embeddings=tied)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**dims, tie_word_embeddings=tied)
        model = transformers.Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # random biases, so a dropped one would show
            for layer in model.model.layers:
                attn = layer.self_attn
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model = model.float().eval()
    out = tmp_path / f"{kind}{'_tied' if tied else ''}{'_sharded' if shard else ''}"
    model.save_pretrained(
        out, safe_serialization=True, **({"max_shard_size": shard} if shard else {})
    )
    return model, out


def _config(path, policy="continuous", layout="contiguous"):
    cfg = make_config(policy, num_slots=3, backend="runner", clock="passes")
    cfg.model = ModelConfig(name="hf", path=str(path), max_len=128)
    cfg.policy.token_budget, cfg.policy.long_prefill_threshold = 32, 8  # chunked: 8-token chunks
    cfg.memory = MemoryConfig(layout=layout, block_size=16)
    validate(cfg)
    return cfg


CHECKPOINTS = [("llama", False, None), ("qwen2", False, None), ("llama", True, None),
               ("qwen2", False, "40KB")]  # fmt: skip


@pytest.mark.parametrize("kind,tied,shard", CHECKPOINTS)
def test_logits_equal_transformers(tmp_path, kind, tied, shard):
    model, path = _save(tmp_path, kind, tied, shard)
    if shard:
        assert (path / "model.safetensors.index.json").is_file()
        assert len(list(path.glob("*.safetensors"))) > 1
    cfg = _config(path)
    spec = cfg.model.spec()
    assert (spec.qkv_bias, spec.tie_embeddings) == (kind == "qwen2", tied)
    params = model_params(cfg)
    rng = np.random.default_rng(1)
    for n in PROMPTS:
        ids = rng.integers(0, DIMS["vocab_size"], (1, n))
        with torch.no_grad():
            want = model(torch.tensor(ids)).logits.numpy()
        got = np.asarray(jax.jit(full_forward, static_argnums=0)(spec, params, ids))
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def _greedy(model, prompt: np.ndarray, n: int) -> list[int]:
    """transformers' greedy decoding, one whole forward pass per token (no cache, no mask to
    infer from a pad id)."""
    ids = torch.tensor(prompt[None])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_tokens_equal_transformers_under_every_policy_and_layout(tmp_path, kind):
    model, path = _save(tmp_path, kind, init=0.3)
    w = make_workload([9, 21, 4, 14, 30], [6, 3, 8, 5, 4])
    prompts = w.prompts(DIMS["vocab_size"], 128)
    want = [_greedy(model, p[:n], int(m)) for p, n, m in zip(prompts, w.prompt_len, w.max_new)]
    # Every policy and both layouts, each policy once (paged passes equal slot passes:
    # test_paged); Qwen2's passes are Llama's but for the biases: two runs suffice.
    runs = [("static", "contiguous"), ("continuous", "paged"), ("orca", "contiguous"),
            ("chunked", "paged")]  # fmt: skip
    if kind == "qwen2":
        runs = [("continuous", "contiguous"), ("chunked", "paged")]
    for policy, layout in runs:
        res = simulate(_config(path, policy, layout), w)
        got = [list(map(int, t)) for t in res.outputs]
        assert got == want, (policy, layout)


def test_a_broken_checkpoint_is_refused_naming_what_is_wrong(tmp_path):
    _, path = _save(tmp_path, "llama")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="architecture GPT2LMHeadModel; supported: Llama"):
        _config(path)
    (path / "config.json").write_text(json.dumps(config | {"intermediate_size": 100}))
    cfg = _config(path)
    with pytest.raises(ConfigError, match=r"mlp.gate_proj.weight has shape \(112, 64\), "
                                          r"config.json implies \(100, 64\)"):  # fmt: skip
        model_params(cfg)
    (path / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 3}))
    with pytest.raises(ConfigError, match=r"tensor model.layers.2.input_layernorm.weight is "
                                          r"missing \(and 8 more\)"):  # fmt: skip
        model_params(_config(path))
    with pytest.raises(ConfigError, match="model.max_len=512 is not valid: its config.json's "
                                          "max_position_embeddings is 256"):  # fmt: skip
        cfg = _config(path)
        cfg.model = dataclasses.replace(cfg.model, max_len=512)
        validate(cfg)


def test_the_checkpoints_eos_ends_a_request_unless_ignored(tmp_path):
    """config.json's eos_token_id ends a request at that token (kept as its last); with
    engine.ignore_eos every request runs to its budget, as a trace replay needs."""
    model, path = _save(tmp_path, "llama", init=0.3)
    w = make_workload([9, 21, 4, 14, 30], [6, 3, 8, 5, 4])
    prompts = w.prompts(DIMS["vocab_size"], 128)
    want = [_greedy(model, p[:n], int(m)) for p, n, m in zip(prompts, w.prompt_len, w.max_new)]
    eos = want[0][2]  # a token request 0 emits third
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"eos_token_id": [eos, eos + 1]}))
    cfg = _config(path)
    assert cfg.model.eos_id == eos
    ended = [t[: t.index(eos) + 1] if eos in t else t for t in want]
    assert ended != want and len(ended[0]) == 3
    assert [list(map(int, t)) for t in simulate(cfg, w).outputs] == ended
    cfg.engine.ignore_eos = True
    assert [list(map(int, t)) for t in simulate(cfg, w).outputs] == want


def test_text_prompts_through_the_checkpoints_tokenizer(tmp_path):
    """workload.kind=text: JSONL prompts tokenised by model.path's tokenizer.json; tokens.jsonl
    carries each output's ids and their text; the ids are transformers' greedy tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    model, path = _save(tmp_path, "llama", init=0.3)
    vocab = {f"w{i}": i for i in range(DIMS["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    prompts = ["w3 w17 w5 w60", "w1 w2", "w90 w91 w92 w93 w94 w95 w7"]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": p, "max_new_tokens": 3 + i}) + "\n"
                             for i, p in enumerate(prompts)))  # fmt: skip
    cfg = _config(path)
    cfg.workload = dataclasses.replace(cfg.workload, kind="text", path=str(jsonl))
    cfg.output = dataclasses.replace(cfg.output, tokens=True)
    execute(cfg, tmp_path / "run")
    rows = [json.loads(r) for r in (tmp_path / "run" / "tokens.jsonl").read_text().splitlines()]
    for i, (prompt, row) in enumerate(zip(prompts, rows, strict=True)):
        ids = np.array([int(w[1:]) for w in prompt.split()])
        assert row["tokens"] == _greedy(model, ids, 3 + i)
        assert row["text"] == " ".join(f"w{t}" for t in row["tokens"])
    jsonl.write_text('{"prompt": "w1", "max_new_tokens": "many"}\n')
    with pytest.raises(WorkloadError, match=r"prompts.jsonl:1: each line is a JSON object"):
        execute(cfg, tmp_path / "bad")
