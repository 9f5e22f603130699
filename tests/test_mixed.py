"""The mixed pass (one flattened batch of tokens from many slots) against separate prefill and
decode passes, and chunked prefill against one-shot prefill, in the slot and paged layouts."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxbatch.backend import executables
from jaxbatch.backend.runner import Runner, Sampling, _pass
from jaxbatch.model import pass_attention
from jaxbatch.model.kvcache import segment_bounds
from jaxbatch.sched.blocks import MemorySpec
from jaxbatch.sched.state import DECODE, MIXED, PREFILL, Plan
from tests.conftest import make_workload

PAGED = MemorySpec(4 * 256, 256, "paged", block_size=16)


def _runner(spec, params, prompts, memory):
    w = make_workload(prompts, [8] * len(prompts))
    return Runner(spec, params, 2, w.prompts(spec.vocab_size, spec.max_len), w.prompt_len,
                  with_logits=True, memory=memory)  # fmt: skip


def _execute(runner, kind, req, num_tokens, start):
    i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    # Paged: slot s owns blocks s*16 .. s*16+15 (each slot a disjoint, fixed region).
    table = (np.arange(2)[:, None] * 16 + np.arange(runner.max_blocks)[None, :]).astype(np.int32)
    plan = Plan(i32(req), i32(num_tokens), i32(start), np.int32(kind), np.float32(0), table)
    tokens, logits = runner.execute(plan, runner.buckets.shape_of(plan))
    return np.asarray(tokens), np.asarray(logits)


@pytest.mark.parametrize("memory", [None, PAGED], ids=["slot", "paged"])
@pytest.mark.parametrize("second", [9, 90])  # 90: its rows span two of the own keys' row blocks
def test_mixed_pass_equals_separate_prefill_and_decode(spec, params, memory, second):
    prompts = [20, second]
    # Separate: prefill 0, then prefill 1, then decode 0.
    a = _runner(spec, params, prompts, memory)
    tok0, _ = _execute(a, PREFILL, [0, -1], [20, 0], [0, 0])
    _, pre1 = _execute(a, PREFILL, [-1, 1], [0, second], [0, 0])
    _, dec0 = _execute(a, DECODE, [0, -1], [1, 0], [20, 0])
    # Mixed: prefill 0, then one pass holding 0's decode and 1's whole prompt.
    b = _runner(spec, params, prompts, memory)
    tok0_b, _ = _execute(b, PREFILL, [0, -1], [20, 0], [0, 0])
    assert tok0_b[0] == tok0[0]
    tokens, mixed = _execute(b, MIXED, [0, 1], [1, second], [20, 0])
    np.testing.assert_allclose(mixed[0], dec0[0], atol=1e-4)
    np.testing.assert_allclose(mixed[1], pre1[1], atol=1e-4)
    np.testing.assert_array_equal(tokens, [dec0[0].argmax(), pre1[1].argmax()])


def _kv(runner, slot, n):
    """Layer 0's K of a slot's first n positions, in position order: [n, kv_heads, head_dim]."""
    if runner.paged:  # head-major pool: [kv_heads, block, block_size, D]
        k = np.asarray(runner.cache.k[0])
        blocks = k[:, slot * 16 : slot * 16 + runner.max_blocks].transpose(1, 2, 0, 3)
        return blocks.reshape(-1, *blocks.shape[2:])[:n]
    k = np.concatenate([np.asarray(seg) for seg in runner.cache.k[0]], axis=2)  # the segments
    return k[slot, :, :n].transpose(1, 0, 2)


@pytest.mark.parametrize("memory", [None, PAGED], ids=["slot", "paged"])
@pytest.mark.parametrize("chunks", [[20, 25], [16, 16, 13], [7, 30, 1, 7], [70, 130]])
def test_chunked_prefill_equals_one_shot(spec, params, memory, chunks):
    n = sum(chunks)
    prompts = [n, 5]
    one = _runner(spec, params, prompts, memory)
    _, whole = _execute(one, PREFILL, [0, -1], [n, 0], [0, 0])
    chunked = _runner(spec, params, prompts, memory)
    start = 0
    for size in chunks:
        plan = Plan(*(np.asarray(x, np.int32) for x in ([0, -1], [size, 0], [start, 0], MIXED)),
                    np.float32(0), np.zeros((2, 0), np.int32))  # fmt: skip
        # A mixed pass reads the context cached before it: the bucket of its start, not its end
        # ([70, 130]: 128 positions, where the chunk ends at 200).
        assert chunked.buckets.shape_of(plan).context == chunked.buckets.context(start)
        _, logits = _execute(chunked, MIXED, [0, -1], [size, 0], [start, 0])
        start += size
    np.testing.assert_allclose(logits[0], whole[0], atol=1e-4)
    np.testing.assert_allclose(_kv(chunked, 0, n), _kv(one, 0, n), atol=1e-5)
    # Intermediate chunks leave the prompt in the token buffer intact; the next token follows.
    np.testing.assert_array_equal(
        np.asarray(chunked.token_buf)[0, : n + 1], np.asarray(one.token_buf)[0, : n + 1]
    )


@pytest.mark.parametrize("memory", [None, PAGED], ids=["slot", "paged"])
def test_a_flat_pass_skips_the_context_its_chunks_do_not_see_and_computes_the_same(
    spec, params, memory, monkeypatch
):
    """On the CPU a flat pass skips each cached segment no prompt chunk's row sees (a first chunk
    sees none) with a conditional (`skips_unseen`): its tokens equal, and its logits and the
    cache it writes equal up to float32 rounding (the branches compile apart: 6e-8 apart), those
    of the pass that reads and masks every segment. The passes mix a decode
    at a context in the cache's last segment read, a first chunk (no context), and a later
    chunk that sees the first segment and part of the second."""
    prompts = [150, 100]
    steps = [  # kind, req, num_tokens, start
        (PREFILL, [0, -1], [150, 0], [0, 0]),  # slot 0 cached to 150
        (MIXED, [0, 1], [1, 70], [150, 0]),  # a decode at 150; slot 1's first chunk
        (MIXED, [0, 1], [1, 30], [151, 70]),  # slot 1's second chunk sees 0..69
    ]

    def run():
        r = _runner(spec, params, prompts, memory)
        outs = [_execute(r, *step) for step in steps]
        leaves = [np.asarray(x) for x in jax.tree.leaves(r.cache)]
        return outs, leaves, r

    skipping, skipping_cache, runner = run()
    shape = runner.buckets.shape_of(Plan(*(np.asarray(x, np.int32) for x in steps[1][1:]),
                                         np.int32(MIXED), np.float32(0),
                                         np.zeros((2, 0), np.int32)))  # fmt: skip
    hlo = runner._program(shape, runner._args(runner._idle_rows(shape))).as_text()
    assert pass_attention.skips_unseen() and shape.flat and shape.context > 0
    starts = np.cumsum([0] + [seg.shape[2] for seg in runner.cache.k[0]])[:-1]
    segments = 1 if runner.paged else int((starts < shape.context).sum())  # the tiles read
    assert hlo.count("conditional(") == spec.n_layers * segments
    # The same passes reading every segment: compiled anew, not found in the process or store.
    monkeypatch.setattr(pass_attention, "skips_unseen", lambda: False)
    monkeypatch.setattr(executables, "store", lambda: None)
    executables.clear()
    jax.clear_caches()
    reading, reading_cache, runner = run()
    hlo = runner._program(shape, runner._args(runner._idle_rows(shape))).as_text()
    assert "conditional(" not in hlo
    for (tok_a, log_a), (tok_b, log_b) in zip(skipping, reading):
        np.testing.assert_array_equal(tok_a, tok_b)
        np.testing.assert_allclose(log_a, log_b, rtol=0, atol=1e-5)
    for a, b in zip(skipping_cache, reading_cache):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    executables.clear()
    jax.clear_caches()


@pytest.mark.parametrize("memory", [None, PAGED], ids=["slot", "paged"])
def test_the_positions_a_flat_pass_s_tiles_read_are_those_the_cost_model_prices(
    spec, params, memory, monkeypatch
):
    """The cached positions the runner's query tiles read, segment by segment as its
    conditionals choose (`pass_attention._read` with the skip), equal `Buckets.tile_context`, by
    which the cost model prices them: chunks from position 0 read nothing, a chunk from a
    segment's first position reads the segments before it, one from inside a segment reads that
    segment too; a paged cache reads the whole context as one segment, or nothing."""
    w = make_workload([250] * 4, [4] * 4)
    runner = Runner(spec, params, 4, w.prompts(spec.vocab_size, spec.max_len), w.prompt_len,
                    memory=memory, mixed_rows=256)  # fmt: skip
    b = runner.buckets
    taken = []  # each conditional's choice, in trace order: layer by layer, segment by segment

    def cond(pred, true_fn, false_fn, *operands):
        taken.append(bool(pred))
        return true_fn(*operands) if pred else false_fn(*operands)

    monkeypatch.setattr(jax.lax, "cond", cond)
    table = (np.arange(4)[:, None] * 16 + np.arange(runner.max_blocks)[None, :]).astype(np.int32)
    cases = {  # (num_tokens, start_pos) per slot -> positions the tiles read
        "first chunks and a decode": ([1, 40, 9, 0], [150, 0, 0, 0]),
        "a chunk from 1": ([1, 20, 0, 0], [30, 1, 0, 0]),
        "a chunk from 64, a segment's first": ([1, 20, 0, 0], [200, 64, 0, 0]),
        "a chunk from 65": ([1, 20, 0, 0], [200, 65, 0, 0]),
        "chunks from 10 and 130": ([30, 1, 20, 1], [10, 240, 130, 3]),
        "a chunk from 200": ([40, 0, 0, 0], [200, 0, 0, 0]),
    }
    bounds = np.array(segment_bounds(spec.max_len, b.min_context) if b.min_context
                      else [0, spec.max_len])  # fmt: skip
    read = {}
    for name, (num_tokens, start) in cases.items():
        plan = Plan(np.arange(4, dtype=np.int32), np.array(num_tokens, np.int32),
                    np.array(start, np.int32), np.int32(MIXED), np.float32(0), table)  # fmt: skip
        shape = b.shape_of(plan)
        assert shape.flat and shape.tiles
        taken.clear()
        _pass(*runner._buffers(), plan, spec=spec, shape=shape, sampling=Sampling(),
              num_slots=4, with_logits=False)  # fmt: skip
        starts = bounds[:-1][bounds[:-1] < shape.context]
        lengths = np.minimum(bounds[1 : len(starts) + 1], shape.context) - starts
        per_layer = np.array(taken).reshape(spec.n_layers, len(starts))
        assert (per_layer == per_layer[0]).all()
        read[name] = int(lengths[per_layer[0]].sum())
        assert read[name] == int(b.tile_context(plan, shape.context)), name
    if memory is None:
        assert list(read.values()) == [0, 64, 64, 128, 256, 256]
    else:
        assert read["first chunks and a decode"] == 0 and read["a chunk from 1"] > 0
