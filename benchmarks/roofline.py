"""Every pass kind against this machine's roofline, measured in one process.

First the machine (`calibrate.machine`): read bandwidth (a jitted sum over 64 and 256 MiB; the
best counts) and matmul peak (a jitted 2048 x 2048 matmul, its inputs in the model's dtype:
float32, or bfloat16 for a `-bf16` model, accumulated in float32). Then each pass over a grid,
on the tiny model with 2 and 4 KV heads and on the `small` model (`--models`):
  decode   slots 1..64 x context 64..1024 (every slot decoding at that context);
  prefill  1..16 prompts x 16..512 tokens (from position 0);
  mixed    token budgets 64..512 on 16 slots: 15 decodes at context 256 and one prompt chunk
           filling the budget, starting at position 128 (a second chunk).
Per shape it prints the median pass time over `--repeats` interleaved rounds (each pass once a
round, see `timed`), the bytes and FLOPs the pass needs, and the share of the roofline it
reaches: max(bytes / bandwidth, FLOPs / peak) / time.
  bytes: every weight once (in its dtype; embedding rows used only), the K/V of every cached position
         a request reads (once per request, whatever its rows) and of every position it writes;
  FLOPs: 2 x matmul weights per token fed (the LM head per sampled row), attention 4 x heads x
         head_dim per (query, visible key) pair.
Asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from common import decode_plan, model_spec

from jaxbatch.backend.runner import Runner
from jaxbatch.calibrate import machine
from jaxbatch.model.spec import ModelSpec
from jaxbatch.model.transformer import init_params
from jaxbatch.sched.state import MIXED, PREFILL, Plan

MIXED_SLOTS, MIXED_CONTEXT, CHUNK_START = 16, 256, 128
# The fewest runs a pass's median takes. Medians of 2 (the floor before, with `--repeats 5`) read
# the same 256-row mixed pass (tiny, 4 KV heads) at 50.3% and 35.7% of its roofline in two
# sessions of 2026-12-07; medians of 10 read 50.8% on 2026-12-06.
MIN_RUNS = 5


@dataclass(frozen=True)
class Work:
    """What a pass must do, whatever its padding: tokens fed, rows sampled, cached positions
    read (once per request), and (query, visible key) pairs of attention."""

    tokens: int
    sampled: int
    kv_read: int
    pairs: int

    def bytes(self, spec: ModelSpec) -> float:
        size = jnp.dtype(spec.jnp_dtype).itemsize
        weights = size * (spec.n_layers * layer_params(spec) + spec.vocab_size * spec.d_model)
        embed = size * self.tokens * spec.d_model
        return weights + embed + spec.kv_bytes_per_token * (self.kv_read + self.tokens)

    def flops(self, spec: ModelSpec) -> float:
        matmul = 2 * self.tokens * spec.n_layers * layer_params(spec)
        head = 2 * self.sampled * spec.d_model * spec.vocab_size
        attention = 4 * spec.n_heads * spec.head_dim * self.pairs * spec.n_layers
        return matmul + head + attention


def layer_params(spec: ModelSpec) -> int:
    """Matmul weights of one layer: Q, K, V, O and the SwiGLU MLP."""
    attn = spec.d_model * spec.head_dim * (2 * spec.n_heads + 2 * spec.n_kv_heads)
    return attn + 3 * spec.d_model * spec.d_mlp


def runner_for(spec: ModelSpec, slots: int, prompt_len: int, params=None) -> Runner:
    prompts = np.zeros((slots, spec.max_len), np.int32)
    lens = np.full(slots, prompt_len, np.int32)
    params = init_params(spec, 0) if params is None else params
    return Runner(spec, params, slots, prompts, lens, mixed_rows=512)


def plan(kind: int, num_tokens, start, slots: int) -> Plan:
    i32 = lambda x: np.broadcast_to(np.asarray(x, np.int32), (slots,)).copy()  # noqa: E731
    return Plan(np.arange(slots, dtype=np.int32), i32(num_tokens), i32(start), np.int32(kind),
                np.float32(0), np.zeros((slots, 0), np.int32))  # fmt: skip


def grid(spec: ModelSpec, kinds: list[str]):
    """(kind, shape label, runner, plan, Work) for every pass of the grid."""
    params, runners = init_params(spec, 0), {}

    def runner(slots, prompt_len):
        if (slots, prompt_len) not in runners:
            runners[slots, prompt_len] = runner_for(spec, slots, prompt_len, params)
        return runners[slots, prompt_len]

    if "decode" in kinds:
        for slots in (1, 4, 16, 64):
            for ctx in (64, 256, 1024):
                yield (
                    "decode",
                    f"{slots} slots, context {ctx}",
                    runner(slots, 8),
                    decode_plan(slots, ctx - 1),
                    Work(slots, slots, slots * (ctx - 1), slots * ctx),
                )
    if "prefill" in kinds:
        for prompts in (1, 4, 16):
            for tokens in (16, 64, 256, 512):
                pairs = prompts * tokens * (tokens + 1) // 2
                yield (
                    "prefill",
                    f"{prompts} x {tokens} tokens",
                    runner(prompts, tokens),
                    plan(PREFILL, tokens, 0, prompts),
                    Work(prompts * tokens, prompts, 0, pairs),
                )
    if "mixed" in kinds:
        decodes = MIXED_SLOTS - 1
        for budget in (64, 128, 256, 512):
            chunk = budget - decodes
            num = [1] * decodes + [chunk]
            start = [MIXED_CONTEXT - 1] * decodes + [CHUNK_START]
            chunk_pairs = chunk * CHUNK_START + chunk * (chunk + 1) // 2
            work = Work(budget, MIXED_SLOTS, decodes * (MIXED_CONTEXT - 1) + CHUNK_START,
                        decodes * MIXED_CONTEXT + chunk_pairs)  # fmt: skip
            yield ("mixed", f"budget {budget}: {decodes} decodes + {chunk}-token chunk",
                   runner(MIXED_SLOTS, CHUNK_START + 512),
                   plan(MIXED, num, start, MIXED_SLOTS), work)  # fmt: skip


def timed(passes: list, rounds: int) -> list[float]:
    """Each pass's median seconds over `rounds` interleaved rounds, each pass once a round after
    its compilation and first run (as `jaxbatch-calibrate` times its grid): a slow moment of this
    shared VM then costs each pass one run of its median, where timed back to back it could take
    most of one pass's runs. Back to back, medians of 5: the tiny model's 256-row mixed pass
    read 23.68 ms with 2 KV heads and 16.76 ms with 4, and then 15.06 and 25.05 ms in a second
    run minutes later; 80 runs of each in a row, 14.79 and 16.68 ms, with bursts of 3-4 runs at
    18-26 ms (2026-12-07)."""
    runs = []
    for _, _, runner, p, _ in passes:
        shape = runner.buckets.shape_of(p)
        runner.warmup([shape])
        run = lambda r=runner, p=p, s=shape: r.execute(p, s)[0]  # noqa: E731
        jax.block_until_ready(run())  # its first run, apart
        runs.append(run)
    times = [[] for _ in runs]
    for _ in range(rounds):
        for seconds, run in zip(times, runs):
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            seconds.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7, help="interleaved rounds (at least 5)")
    ap.add_argument("--models", default="tiny-kv2,tiny-kv4,small")
    ap.add_argument("--kinds", default="decode,prefill,mixed")
    args = ap.parse_args()
    bw, peak = machine(args.repeats)  # shared with jaxbatch-calibrate
    peaks = {"float32": peak}
    print(f"machine: read {bw / 1e9:.1f} GB/s, matmul {peak / 1e9:.0f} GFLOP/s "
          f"(balance {peak / bw:.1f} FLOP/byte), backend {jax.default_backend()}")  # fmt: skip
    best: dict[str, float] = {}
    for name in args.models.split(","):
        spec = model_spec(name)
        if spec.dtype not in peaks:
            peaks[spec.dtype] = machine(args.repeats, spec.dtype)[1]
            print(f"machine: matmul of {spec.dtype} inputs {peaks[spec.dtype] / 1e9:.0f} GFLOP/s")
        peak = peaks[spec.dtype]
        print(f"\n{name}: {spec.num_params / 1e6:.1f}M parameters, {spec.n_heads} heads / "
              f"{spec.n_kv_heads} KV heads")  # fmt: skip
        print(f"  {'kind':<8}{'shape':<42}{'ms':>9}{'MB':>9}{'GFLOP':>9}  bound   roof ms  share")
        passes = list(grid(spec, args.kinds.split(",")))
        seconds = timed(passes, max(MIN_RUNS, args.repeats))
        for (kind, label, *_, work), t in zip(passes, seconds):
            nbytes, flops = work.bytes(spec), work.flops(spec)
            roof = max(nbytes / bw, flops / peak)
            share = roof / t
            best[kind] = max(best.get(kind, 0.0), share)
            bound = "memory " if nbytes / bw >= flops / peak else "compute"
            print(f"  {kind:<8}{label:<42}{1e3 * t:9.2f}{nbytes / 1e6:9.1f}{flops / 1e9:9.2f}  "
                  f"{bound} {1e3 * roof:8.2f} {share:6.1%}")  # fmt: skip
    if best:
        top = max(best.values())
        print("\nbest share per kind: " + ", ".join(f"{k} {v:.1%}" for k, v in best.items()))
        print("furthest kind from the best: " + ", ".join(
            f"{k} {top / v:.1f}x" for k, v in best.items()))  # fmt: skip


if __name__ == "__main__":
    main()
