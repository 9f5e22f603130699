"""The decode pass with the paged KV layout against the slot layout, at equal slots and context.

Both runners hold the same requests (every slot decoding at the same position); the paged one
reaches its KV through block tables. Prints median pass times (interleaved repeats) and their
ratio per context length. Asserts nothing.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from common import decode_plan, median

from jaxbatch.backend.runner import Runner
from jaxbatch.model.spec import ModelSpec
from jaxbatch.model.transformer import init_params
from jaxbatch.sched.blocks import MemorySpec


def decode_time(runner: Runner, pos: int, table: np.ndarray, iters: int) -> float:
    plan = decode_plan(runner.num_slots, pos, table)
    device_plan = jax.device_put(plan)
    shape = runner.buckets.shape_of(plan)
    runner.warmup([shape])
    jax.block_until_ready(runner.execute(plan, shape, device_plan)[0])
    t0 = time.perf_counter()
    for _ in range(iters):
        tokens, _ = runner.execute(plan, shape, device_plan)
    jax.block_until_ready(tokens)
    return (time.perf_counter() - t0) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    spec = ModelSpec()
    params = init_params(spec, 0)
    b, bs = args.slots, args.block_size
    prompts = np.zeros((b, spec.max_len), np.int32)
    plen = np.full(b, 8)
    memory = MemorySpec(b * spec.max_len, spec.max_len, "paged", block_size=bs)
    slot = Runner(spec, params, b, prompts, plen)
    paged = Runner(spec, params, b, prompts, plen, memory=memory)
    # Each slot owns a scattered, disjoint set of blocks (a shuffled pool), as after churn.
    ids = np.random.default_rng(0).permutation(memory.num_blocks)[: b * memory.max_blocks]
    table = ids.reshape(b, memory.max_blocks).astype(np.int32)
    no_table = np.zeros((b, 0), np.int32)
    print(f"decode pass, {b} slots, block size {bs}, tiny model (median of {args.repeats})")
    for ctx in (64, 256, 1000):
        t_slot, t_paged = [], []
        for _ in range(args.repeats):
            t_slot.append(decode_time(slot, ctx - 1, no_table, args.iters))
            t_paged.append(decode_time(paged, ctx - 1, table, args.iters))
        ratio = median(t_paged) / median(t_slot)
        print(
            f"context {ctx:5d}: slot {1e3 * median(t_slot):6.2f} ms, "
            f"paged {1e3 * median(t_paged):6.2f} ms, paged/slot = {ratio:.2f}"
        )


if __name__ == "__main__":
    main()
