"""What one jitted call costs besides its pass: the gap the device loop closes and no host loop can.

One decode pass of `slots` slots at one context bucket, run `passes` times three ways (medians of
interleaved repeats, milliseconds per pass):
- back to back: the runner's jitted pass called from Python with no sync between calls (the
  replay floor of `device_loop.py`, and the least any host loop can pay per pass);
- in one call: the same pass as the body of a `lax.fori_loop`, one call for all of them (what the
  device loop pays per pass, less its schedule and commit);
- empty call: a jitted function of the same arguments that computes nothing (Python dispatch).
The first two feed the same tokens at the same positions every pass: the same arithmetic.
Asserts nothing.
"""

from __future__ import annotations

import argparse
import time

import jax
from common import config, decode_plan, median

from jaxbatch.backend.runner import _jitted_pass, _pass
from jaxbatch.config import LengthConfig
from jaxbatch.run import build_backend, memory_spec
from jaxbatch.workload import from_config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--context", type=int, default=128, help="the decode's context bucket")
    ap.add_argument("--passes", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    b, k = args.slots, args.passes
    fixed = LengthConfig(dist="fixed", mean=8)
    cfg = config("continuous", b, b, fixed, fixed)
    runner = build_backend(cfg, from_config(cfg.workload), memory_spec(cfg))
    shape = runner.buckets.decode(args.context)
    plan = jax.device_put(decode_plan(b, args.context - 1))
    static = dict(spec=runner.spec, shape=shape, sampling=runner.sampling, num_slots=b,
                  with_logits=False)  # fmt: skip
    one = _jitted_pass(runner.spec, shape, runner.sampling, b, False)

    def many(params, cache, buf, prompt_len, ids, plan):
        def body(_, carry):
            return _pass(params, *carry, prompt_len, ids, plan, **static)[:2]

        return jax.lax.fori_loop(0, k, body, (cache, buf))

    looped = jax.jit(many, donate_argnums=(1, 2))
    empty = jax.jit(lambda params, cache, buf, *rest: (cache, buf), donate_argnums=(1, 2))
    r = runner

    def args_():
        return r.params, r.cache, r.token_buf, r.prompt_len, r.request_ids, plan

    def back_to_back():
        for _ in range(k):
            r.cache, r.token_buf, tokens, _ = one(*args_())
        jax.block_until_ready(tokens)

    def in_one_call():
        r.cache, r.token_buf = jax.block_until_ready(looped(*args_()))

    def empty_calls():
        for _ in range(k):
            r.cache, r.token_buf = empty(*args_())
        jax.block_until_ready(r.token_buf)

    ways = {"back to back": back_to_back, "in one call": in_one_call, "empty call": empty_calls}
    times = {name: [] for name in ways}
    for fn in ways.values():  # compile and run each once
        fn()
    for _ in range(args.repeats):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) / k * 1e3)
    print(f"decode pass, {b} slots, context {shape.context}, {k} passes, median of {args.repeats}:")
    for name, ms in times.items():
        print(f"  {name:13s} {median(ms):7.3f} ms per pass")
    a, c, e = (median(times[n]) for n in ways)
    print(f"  back to back / in one call = {a / c:.2f}; per-call cost {a - c:.3f} ms, "
          f"of which Python dispatch ~{e:.3f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
