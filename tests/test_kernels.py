"""The fused attention kernels (model.attention=cudnn, pallas) against the portable path.

cuDNN runs only on a GPU: here the very code of the cudnn path runs with JAX's own XLA
implementation of `jax.nn.dot_product_attention` in its place (the one string that differs), so
the layouts, masks and log-sum-exp merge are checked. The Pallas paged attention kernel runs in
Pallas's TPU interpret mode on the CPU. `benchmarks/device_run.sh` checks both on their devices."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import jaxbatch.config
from jaxbatch.config import ConfigError, MemoryConfig, validate
from jaxbatch.model import kernels
from jaxbatch.model.attention import merge, partial
from jaxbatch.run import simulate
from tests.conftest import make_config, make_workload
from tests.test_batch_invariance import per_request_logits

PROMPTS, BUDGETS = [13, 40, 7, 22], [6, 4, 9, 5]
PAGED = MemoryConfig(layout="paged", budget_tokens=1024, block_size=16)


@pytest.mark.parametrize(("n", "t", "h", "hkv", "shared"), [
    (3, 1, 4, 2, False), (2, 5, 4, 4, False), (6, 1, 4, 2, True), (2, 3, 4, 1, True),
])  # fmt: skip
def test_fused_partial_merges_as_the_portable_partial(monkeypatch, n, t, h, hkv, shared):
    monkeypatch.setattr(kernels, "CUDNN_IMPLEMENTATION", "xla")
    rng = np.random.default_rng(0)
    c, d = 9, 8
    q = jnp.asarray(rng.normal(size=(n, t, h, d)), jnp.float32)
    kv_shape = (hkv, c, d) if shared else (n, hkv, c, d)
    k, v = (jnp.asarray(rng.normal(size=kv_shape), jnp.float32) for _ in "kv")
    visible = jnp.asarray(rng.random((n, t, c)) < 0.5).at[0, 0].set(False)  # one sees no key
    k2, v2 = (jnp.asarray(rng.normal(size=(n, hkv, 4, d)), jnp.float32) for _ in "kv")
    other = partial(q, k2, v2, jnp.ones((n, t, 4), bool))  # a second key set to merge with
    for extra in ([], [other]):
        want = merge([partial(q, k, v, visible), *extra], jnp.float32)
        got = merge([kernels.fused_partial(q, k, v, visible), *extra], jnp.float32)
        seen = np.asarray(visible.any(-1) | bool(extra))[..., None, None]
        np.testing.assert_allclose(np.where(seen, got, 0), np.where(seen, want, 0), atol=1e-5)


def _logits(policy, memory, attention="xla", pallas=False):
    cfg = make_config(policy, num_slots=3, clock="passes")
    # The Pallas kernel reads K/V as bfloat16: its runs store them so, and so do their references.
    kv_dtype = "bfloat16" if pallas else "auto"
    cfg.model = dataclasses.replace(cfg.model, attention=attention, kv_dtype=kv_dtype)
    cfg.memory, cfg.policy.token_budget = memory, 32
    res = simulate(cfg, make_workload(PROMPTS, BUDGETS), with_logits=True)
    return per_request_logits(res, len(PROMPTS)), res


@pytest.mark.parametrize(("policy", "memory", "attention"), [
    ("continuous", MemoryConfig(), "cudnn"),  # prefill passes and decodes, slot layout
    ("chunked", PAGED, "cudnn"),  # mixed passes: chunks tiled, decodes, every row's own keys
    ("continuous", PAGED, "pallas"),  # paged decodes in the Pallas kernel (K/V in bfloat16)
])  # fmt: skip
def test_kernel_logits_equal_the_portable_path(monkeypatch, policy, memory, attention):
    pallas = attention == "pallas"
    want, ref = _logits(policy, memory, pallas=pallas)
    monkeypatch.setattr(kernels, "CUDNN_IMPLEMENTATION", "xla")
    monkeypatch.setattr(jaxbatch.config, "choose", lambda requested, *_: (requested, ""))
    with pltpu.force_tpu_interpret_mode():
        got, res = _logits(policy, memory, attention, pallas)
    assert res.record.num_passes == ref.record.num_passes
    for i in range(len(PROMPTS)):
        np.testing.assert_allclose(got[i], want[i], atol=1e-4)
        np.testing.assert_array_equal(res.outputs[i], ref.outputs[i])


def test_a_kernel_runs_only_where_it_can(capsys):
    assert kernels.choose("cudnn", "gpu", "bfloat16", False, 1) == ("cudnn", "")
    assert kernels.choose("pallas", "tpu", "float32", True, 1) == ("pallas", "")
    assert kernels.choose("cudnn", "gpu", "float32", False, 1)[0] == "xla"
    assert kernels.choose("pallas", "tpu", "bfloat16", False, 1)[1].endswith("set memory=paged")
    assert kernels.choose("cudnn", "gpu", "bfloat16", False, 8)[0] == "xla"
    cfg = make_config()
    cfg.model = dataclasses.replace(cfg.model, attention="cudnn")
    validate(cfg)  # this machine is a CPU: one message, then the portable path
    assert cfg.model.attention == "xla"
    err = capsys.readouterr().err
    assert "model.attention: cuDNN attention runs on a GPU; this is cpu; using xla" in err
    cfg.model.attention = "flash"
    with pytest.raises(ConfigError, match="model.attention.*use one of xla, cudnn, pallas"):
        validate(cfg)
