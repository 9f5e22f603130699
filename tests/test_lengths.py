"""Every prompt length from 1 to the largest bucket below the model's max_len, with grouped-query
and multi-head attention: a one-shot prefill, the same prompt prefilled in two chunks (mixed
passes), and the decode after either give the uncached forward pass's logits. One layer: what
varies here is the length (masks, buckets, positions); test_model checks each layer's cache."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.backend.runner import Runner
from jaxbatch.model.transformer import full_forward, init_params
from jaxbatch.sched.state import DECODE, MIXED, PREFILL, Plan
from tests.conftest import make_workload

SLOTS = 16
reference = jax.jit(full_forward, static_argnums=0)


def _run(runner, kind, req, num_tokens, start):
    i32 = lambda x: np.broadcast_to(np.asarray(x, np.int32), (SLOTS,)).copy()  # noqa: E731
    table = np.zeros((SLOTS, 0), np.int32)
    plan = Plan(i32(req), i32(num_tokens), i32(start), np.int32(kind), np.float32(0), table)
    _, logits = runner.execute(plan, runner.buckets.shape_of(plan))
    return np.asarray(logits)


def test_every_prompt_length_prefilled_chunked_and_decoded(spec):
    spec = dataclasses.replace(spec, n_layers=1)
    params = init_params(spec, 0)
    lengths = np.arange(1, spec.max_len)  # the decode after the longest writes position max_len-1
    w = make_workload(lengths, np.full(len(lengths), 2))
    prompts = w.prompts(spec.vocab_size, spec.max_len)
    one, two = (
        Runner(spec, params, SLOTS, prompts, lengths, with_logits=True) for _ in range(2)
    )  # fmt: skip
    got = {"prefill": [], "chunked": [], "decode": [], "chunked decode": []}
    for first in range(0, len(lengths), SLOTS):
        req = np.arange(first, first + SLOTS) % len(lengths)  # the last group wraps around
        n = lengths[req]
        got["prefill"].append(_run(one, PREFILL, req, n, 0))
        head = n - n // 2  # first chunk (all of a 1-token prompt), then the rest (maybe none)
        last_chunk = _run(two, MIXED, req, head, 0)
        rest = _run(two, MIXED, np.where(n // 2 > 0, req, -1), n // 2, head)
        got["chunked"].append(np.where((n // 2 > 0)[:, None], rest, last_chunk))
        got["decode"].append(_run(one, DECODE, req, 1, n))
        got["chunked decode"].append(_run(two, DECODE, req, 1, n))
    # Both runners drew the same greedy token after every prompt.
    buf = np.asarray(one.token_buf)
    np.testing.assert_array_equal(buf, np.asarray(two.token_buf))
    ref = np.asarray(reference(spec, params, jnp.asarray(buf[:, : spec.max_len])))
    order = np.arange(-(-len(lengths) // SLOTS) * SLOTS) % len(lengths)
    at_prompt_end = ref[order, lengths[order] - 1]
    after_one_token = ref[order, lengths[order]]
    expected = {"prefill": at_prompt_end, "chunked": at_prompt_end, "decode": after_one_token,
                "chunked decode": after_one_token}  # fmt: skip
    for name, want in expected.items():
        np.testing.assert_allclose(np.concatenate(got[name]), want, atol=2e-4, err_msg=name)
    np.testing.assert_array_equal(
        buf[np.arange(len(lengths)), lengths], at_prompt_end.argmax(-1)[: len(lengths)]
    )
