"""Engine overhead: a raw loop of the jitted passes against the engine, at the same shapes.

Decode-heavy workload: `slots` offline requests of 32 prompt tokens and `new` output tokens each,
so the engine runs one prefill pass and new-1 decode passes with growing context buckets. The raw
loop calls the same compiled functions with precomputed inputs and no host sync, schedule or
commit. Prints both tokens/s (medians, interleaved repeats) and their ratio. Asserts nothing.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from common import config, decode_plan, median

from jaxbatch.backend.runner import _jitted_pass
from jaxbatch.config import LengthConfig
from jaxbatch.run import build_backend, memory_spec, simulate
from jaxbatch.workload import from_config


def raw_loop(cfg, workload) -> float:
    """Seconds for the prefill and every decode pass, dispatched back to back."""
    runner = build_backend(cfg, workload, memory_spec(cfg))
    b, plen, new = cfg.engine.num_slots, int(workload.prompt_len[0]), int(workload.max_new[0])
    req, no_blocks = np.arange(b, dtype=np.int32), np.zeros((b, 0), np.int32)
    prefill = runner.buckets.prefill(b, plen, plen)
    calls = [(prefill, (req, req, np.zeros(b, np.int32), np.full(b, plen, np.int32),
                        np.ones(b, bool), no_blocks))]  # fmt: skip
    for step in range(new - 1):  # a decode shape takes the whole plan
        plan = decode_plan(b, plen + step)
        calls.append((runner.buckets.decode(plen + step + 1), (plan,)))
    fns = {shape: _jitted_pass(runner.spec, shape, runner.sampling, b, False) for shape, _ in calls}
    runner.warmup(list(fns))
    t0 = time.perf_counter()
    for shape, rows in calls:
        runner.cache, runner.token_buf, tokens, _ = fns[shape](
            runner.params, runner.cache, runner.token_buf, runner.prompt_len, runner.request_ids,
            *rows,
        )  # fmt: skip
    jax.block_until_ready(tokens)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--new", type=int, default=480)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    fixed = lambda n: LengthConfig(dist="fixed", mean=n)  # noqa: E731
    cfg = config("continuous", args.slots, args.slots, fixed(32), fixed(args.new))
    workload = from_config(cfg.workload)
    tokens = args.slots * args.new
    raw, engine = [], []
    for _ in range(args.repeats):
        raw.append(tokens / raw_loop(cfg, workload))
        res = simulate(cfg, workload)
        assert res.record.emits.sum() == tokens
        engine.append(tokens / res.duration_s)
    print(
        f"raw jitted loop: median {median(raw):8.1f} tok/s  ({args.slots} slots, {args.new} passes)"
    )
    print(f"engine:          median {median(engine):8.1f} tok/s")
    print(f"engine / raw = {median(engine) / median(raw):.3f}")


if __name__ == "__main__":
    main()
