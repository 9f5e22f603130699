"""Cached prefill + decode passes against the uncached full forward pass."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.backend.buckets import Buckets
from jaxbatch.backend.runner import Runner
from jaxbatch.model.attention import rope_tables
from jaxbatch.model.kvcache import CacheIndex, init_paged_cache, init_slot_cache, values
from jaxbatch.model.transformer import full_forward
from jaxbatch.sched.state import DECODE, PREFILL, Plan
from tests.conftest import TEST_MODEL, make_workload

reference = jax.jit(full_forward, static_argnums=0)


def _execute(runner, req, num_tokens, start, kind):
    i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    table = np.full((len(req), runner.max_blocks), -1, np.int32)
    plan = Plan(i32(req), i32(num_tokens), i32(start), np.int32(kind), np.float32(0), table)
    return runner.execute(plan, runner.buckets.shape_of(plan))


def test_cached_passes_match_full_forward(spec, params):
    # Prompt lengths across several buckets (16, 32, 64, 128), decoded for 6 more tokens.
    rng = np.random.default_rng(1)
    prompt_len = np.array([3, 17, 40, 100])
    w = make_workload(prompt_len, np.full(4, 8))
    runner = Runner(spec, params, 4, w.prompts(spec.vocab_size, spec.max_len), prompt_len,
                    with_logits=True)  # fmt: skip
    order = rng.permutation(4)  # slots in a shuffled order, so slot != request id
    tokens, logits = _execute(runner, order, prompt_len[order], [0] * 4, PREFILL)
    seen = {int(order[s]): [np.asarray(logits[s])] for s in range(4)}
    for step in range(6):
        tokens, logits = _execute(runner, order, [1] * 4, prompt_len[order] + step, DECODE)
        for s in range(4):
            seen[int(order[s])].append(np.asarray(logits[s]))
    buf = np.asarray(runner.token_buf)
    for r in range(4):
        n = prompt_len[r] + 7  # prompt + 7 generated tokens, the last not fed back
        ref = np.asarray(reference(spec, params, jnp.asarray(buf[r : r + 1, : n - 1])))[0]
        got = np.stack(seen[r])
        np.testing.assert_allclose(got, ref[prompt_len[r] - 1 :], atol=1e-4)
        # Greedy: each generated token is the argmax of the reference logits before it.
        np.testing.assert_array_equal(
            buf[r, prompt_len[r] : n], ref[prompt_len[r] - 1 :].argmax(-1)
        )


def test_padding_rows_write_nothing(spec, params):
    """Warm-up runs every bucket with padding rows only: the cache must come out unchanged."""
    w = make_workload([20, 5], [4, 4])
    runner = Runner(spec, params, 2, w.prompts(spec.vocab_size, spec.max_len), w.prompt_len)
    _execute(runner, [0, 1], [20, 5], [0, 0], PREFILL)
    before = [np.asarray(x).copy() for x in jax.tree.leaves(runner.cache)]
    buf_before = np.asarray(runner.token_buf).copy()
    runner.warmup(Buckets(2, spec.max_len).for_workload(w.prompt_len, w.max_new))
    for a, b in zip(before, jax.tree.leaves(runner.cache)):
        np.testing.assert_array_equal(a, np.asarray(b))
    np.testing.assert_array_equal(buf_before, np.asarray(runner.token_buf))


def test_bfloat16_cached_passes_match_the_bfloat16_full_forward(spec, params):
    """bfloat16 matmul inputs and cache, float32 accumulation: a cached pass and the uncached
    forward pass round at different places, so they agree to bfloat16's precision only."""
    spec = dataclasses.replace(spec, dtype="bfloat16")
    prompt_len = np.array([5, 30, 70])
    w = make_workload(prompt_len, np.full(3, 4))
    runner = Runner(spec, params, 3, w.prompts(spec.vocab_size, spec.max_len), prompt_len,
                    with_logits=True)  # fmt: skip
    assert values(runner.cache.k[0][0]).dtype == jnp.bfloat16
    _, logits = _execute(runner, [0, 1, 2], prompt_len, [0] * 3, PREFILL)
    seen = [[np.asarray(logits[r])] for r in range(3)]
    for step in range(3):
        _, logits = _execute(runner, [0, 1, 2], [1] * 3, prompt_len + step, DECODE)
        for r in range(3):
            seen[r].append(np.asarray(logits[r]))
    buf = np.asarray(runner.token_buf)
    for r in range(3):
        n = prompt_len[r] + 3
        ref = np.asarray(reference(spec, params, jnp.asarray(buf[r : r + 1, :n])))[0]
        got, want = np.stack(seen[r]), ref[prompt_len[r] - 1 :]
        # Measured: at most 1.7e-3 on logits up to 0.6 (float32 paths agree to 1e-4).
        np.testing.assert_allclose(got, want, atol=5e-3)


def test_rope_tables_equal_the_closed_form_at_every_position():
    """cos and sin of position * theta^(-2i/D), looked up for any position of the table, and
    for an uncached sequence longer than max_len."""
    d, theta = 8, 500.0
    inv_freq = theta ** (-np.arange(0, d, 2) / d)
    for max_len, positions in ((64, [[0, 1, 63], [17, 40, 2]]), (4, [[0, 1, 2, 3, 4, 5]])):
        pos = np.asarray(positions, np.int32)
        cos, sin = rope_tables(jnp.asarray(pos), d, theta, max_len)
        assert cos.shape == (*pos.shape, 1, d // 2)
        angles = pos[..., None, None] * inv_freq
        np.testing.assert_allclose(np.asarray(cos), np.cos(angles), atol=2e-5)
        np.testing.assert_allclose(np.asarray(sin), np.sin(angles), atol=2e-5)


def test_a_bfloat16_cache_is_written_in_place_and_reads_back_what_was_written():
    """A bfloat16 cache on the CPU holds bit patterns (`kvcache.storage_dtype`), so a write
    scatters in place: the compiled write makes no float32 copy of a cache array (XLA's CPU
    backend converted each bfloat16 array a write went to into float32 whole, and back). A read
    gives exactly the bfloat16 values written, in both layouts; positions never written read 0."""
    spec = dataclasses.replace(TEST_MODEL.spec(), kv_dtype="bfloat16")
    kv, hd = spec.n_kv_heads, spec.head_dim
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.normal(size=(3, 2, kv, hd)), jnp.float32) for _ in range(2))
    positions = jnp.array([[5, 6], [70, 71], [130, 131]], jnp.int32)
    valid = jnp.array([[True, True], [True, False], [True, True]])
    table = jnp.array([[0, 1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17],
                       [18, 19, 20, 21, 22, 23, 24, 25, 26]], jnp.int32)  # fmt: skip
    for cache, index in (
        (init_slot_cache(spec, 3), CacheIndex(None, positions, valid)),
        (init_paged_cache(spec, 27, 16), CacheIndex(None, positions, valid, table)),
    ):
        write = jax.jit(lambda c, k, v, i: c.write_layer(0, k, v, i), donate_argnums=0)
        hlo = write.lower(cache, k, v, index).compile().as_text()
        for array in jax.tree.leaves(cache):
            assert f"f32[{','.join(map(str, array.shape))}]" not in hlo
        cache = write(cache, k, v, index)
        read = cache.read(0, index, 144)  # the slot layout: whole segments, 256 positions
        got_k, got_v = (np.concatenate([np.asarray(x[j], np.float32) for x in read], 2)[:, :, :144]
                        for j in (0, 1))  # fmt: skip
        want_k, want_v = np.zeros_like(got_k), np.zeros_like(got_v)
        for r in range(3):
            for t in range(2):
                if valid[r, t]:
                    p = int(positions[r, t])
                    want_k[r, :, p] = np.asarray(k[r, t].astype(jnp.bfloat16), np.float32)
                    want_v[r, :, p] = np.asarray(v[r, t].astype(jnp.bfloat16), np.float32)
        np.testing.assert_array_equal(got_k, want_k)
        np.testing.assert_array_equal(got_v, want_v)
