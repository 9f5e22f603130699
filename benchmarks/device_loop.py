"""The same offline workload through the host loop and the device loop on the runner (chunked policy,
tiny model): prints output tokens/s of each (medians, interleaved) and their ratio. The device
loop's time excludes its compilation and warm-up, as the host loop's excludes its warm-up.

A third figure, `replay`, dispatches the host loop's recorded passes back to back from Python,
with no schedule, commit or host sync: the time of those compiled passes alone. The host loop's
distance to it is its per-pass host work; the device loop can pass it, since it dispatches nothing.
Asserts nothing.

Defaults: a decode-heavy workload (short prompts, long outputs) on 4 and then 8 slots, 4 requests
per slot. The host's work per pass is about the same at both sizes, so it weighs most where
passes are cheapest. `--prompt 64 128 --output 4 8 --budget 64` gives a prefill-heavy workload.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import numpy as np
from common import config, median

from jaxbatch.config import LengthConfig
from jaxbatch.report.recorder import Record
from jaxbatch.run import build_backend, memory_spec, simulate
from jaxbatch.sched.state import Plan
from jaxbatch.workload import from_config


def replay(cfg, workload, memory, record: Record, max_blocks: int) -> float:
    """Seconds to run the recorded passes back to back (slot layout: no block tables)."""
    runner = build_backend(cfg, workload, memory)
    b = cfg.engine.num_slots
    plans = [
        Plan(
            req=record.req[p],
            num_tokens=record.num_tokens[p],
            start_pos=record.start_pos[p],
            kind=np.int32(record.kind[p]),
            wait_until=np.float32(0),
            block_table=np.zeros((b, max_blocks), np.int32),
        )  # fmt: skip
        for p in range(record.num_passes)
    ]
    shapes = [runner.buckets.shape_of(plan) for plan in plans]
    runner.warmup(sorted(set(shapes), key=str))
    t0 = time.perf_counter()
    for plan, shape in zip(plans, shapes):
        tokens, _ = runner.execute(plan, shape)
    jax.block_until_ready(tokens)
    return time.perf_counter() - t0


def measure(args, slots: int) -> None:
    """Host loop, device loop and replay on `slots` slots, interleaved; prints one block."""
    prompt = LengthConfig(dist="uniform", low=args.prompt[0], high=args.prompt[1])
    output = LengthConfig(dist="uniform", low=args.output[0], high=args.output[1])
    n = args.requests_per_slot * slots
    cfg = config("chunked", slots, n, prompt, output)
    cfg.policy.token_budget = args.budget
    w = from_config(cfg.workload)
    memory = memory_spec(cfg)
    device_cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, loop="device"))
    host, device, floor = [], [], []
    for _ in range(args.repeats):
        res = simulate(cfg, w)
        tokens = res.record.emits.sum()
        host.append(tokens / res.duration_s)
        out = simulate(device_cfg, w)
        device.append(out.record.emits.sum() / out.duration_s)
        same = all((a == b).all() for a, b in zip(out.outputs, res.outputs))
        floor.append(tokens / replay(cfg, w, memory, res.record, memory.max_blocks))
    kinds = np.bincount(res.record.kind, minlength=4)
    print(
        f"chunked, budget {args.budget}, {n} offline requests, {slots} slots, "
        f"prompts {args.prompt}, outputs {args.output}: {res.record.num_passes} passes "
        f"({kinds[3]} mixed, {kinds[2]} decode)"
    )
    print(f"  host loop:  median {median(host):8.1f} tok/s")
    print(
        f"  device loop: median {median(device):8.1f} tok/s "
        f"(compile + warm-up {out.warmup_s:.1f} s, excluded)"
    )
    print(f"  replay:     median {median(floor):8.1f} tok/s (the host's passes, back to back)")
    print(f"  device / host = {median(device) / median(host):.2f}; identical tokens: {same}")
    print(f"  device / replay = {median(device) / median(floor):.2f}, host / replay = "
          f"{median(host) / median(floor):.2f}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--slots", type=int, nargs="+", default=(4, 8))
    ap.add_argument("--requests-per-slot", type=int, default=4)
    ap.add_argument("--prompt", type=int, nargs=2, default=(8, 32), help="uniform low high")
    ap.add_argument("--output", type=int, nargs=2, default=(128, 256), help="uniform low high")
    args = ap.parse_args()
    for slots in args.slots:
        measure(args, slots)


if __name__ == "__main__":
    main()
