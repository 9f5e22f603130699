"""`jaxbatch-calibrate`: fit the cost model to this machine's runner, as hardware `cpu_local`.

It measures the machine (read bandwidth: a jitted sum over 64-256 MiB; peak: a jitted 2048 x 2048
float32 matmul), times the real runner's passes over a grid of shapes (decode: slots x context;
prefill: prompts x tokens; mixed: decodes plus a prompt chunk filling a token budget), prices each
pass's work with `cost_model.pass_work`, and fits the entry's compute, memory and attention
efficiencies and per-pass overhead to the times by least squares on the relative error, holding
out every fourth shape. A pass in a run also costs the host loop's own work (schedule, commit,
one sync), which a pass timed alone does not: the overhead written is the median, over the
passes of a real run (continuous, 64 requests), of each pass's measured time less its priced work.
It prints the fit's error per shape, held-out shapes marked, and writes
configs/hardware/cpu_local.yaml. Matmuls are priced at the runner's padded shape (the entry's
`padded`), as the runner computes them; attention at each request's own lengths.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.backend.cost_model import pass_work
from jaxbatch.backend.runner import Runner
from jaxbatch.config import (
    Config,
    EngineConfig,
    LengthConfig,
    ModelConfig,
    OutputConfig,
    WorkloadConfig,
)
from jaxbatch.model.spec import ModelSpec
from jaxbatch.model.transformer import init_params
from jaxbatch.run import simulate
from jaxbatch.sched.state import DECODE, MIXED, PREFILL, Plan
from jaxbatch.workload import from_config

HARDWARE_DIR = Path(__file__).resolve().parents[1] / "configs" / "hardware"


def _times(fn, repeats: int) -> list[float]:
    """Seconds of `repeats` runs of `fn`, run once first so compilation is not timed."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return times


def best_time(fn, repeats: int) -> float:
    """Median seconds of `fn`."""
    return statistics.median(_times(fn, repeats))


def fastest(fn, repeats: int) -> float:
    """The fewest seconds `fn` took in `repeats` runs: a limit of the machine is the best it
    reaches."""
    return min(_times(fn, repeats))


def machine(repeats: int = 5) -> tuple[float, float]:
    """(read bytes/s, matmul FLOP/s): the best this process reaches, each from its fastest run.
    A median counted this shared VM's slow moments against the limit: the same 2048 x 2048
    matmul's median read 233 and 307 GFLOP/s minutes apart, and passes then appeared faster
    than their roofline."""
    total = jax.jit(jnp.sum)
    bandwidth = 0.0
    for mib in (64, 256):
        x = jnp.ones(mib * 2**20 // 4, jnp.float32)
        bandwidth = max(bandwidth, mib * 2**20 / fastest(lambda x=x: total(x), 4 * repeats))
    a = jnp.ones((2048, 2048), jnp.float32)
    matmul = jax.jit(lambda a: a @ a)
    peak = 2 * 2048**3 / fastest(lambda: matmul(a), 4 * repeats)
    return bandwidth, peak


def _plan(kind: int, num_tokens, start, slots: int) -> Plan:
    i32 = lambda x: np.broadcast_to(np.asarray(x, np.int32), (slots,)).copy()  # noqa: E731
    return Plan(np.arange(slots, dtype=np.int32), i32(num_tokens), i32(start), np.int32(kind),
                np.float32(0), np.zeros((slots, 0), np.int32))  # fmt: skip


def shapes() -> list[tuple[str, int, Plan]]:
    """(label, slots, plan) of every pass of the grid."""
    out = []
    for slots in (1, 4, 16):
        for ctx in (64, 256, 1024):
            out.append((f"decode {slots} x context {ctx}", slots, _plan(DECODE, 1, ctx - 1, slots)))
    for prompts in (1, 4, 16):
        for tokens in (16, 64, 256):
            label = f"prefill {prompts} x {tokens}"
            out.append((label, prompts, _plan(PREFILL, tokens, 0, prompts)))
    for decodes in (3, 15):
        for budget in (64, 128, 256, 512):
            chunk = budget - decodes
            num, start = [1] * decodes + [chunk], [255] * decodes + [128]
            label = f"mixed {decodes} decodes + {chunk}-token chunk"
            out.append((label, decodes + 1, _plan(MIXED, num, start, decodes + 1)))
    return out


def time_passes(spec: ModelSpec, repeats: int) -> list[tuple[str, Plan, int, float]]:
    """Each grid pass on the real runner: (label, plan, tokens computed, median seconds)."""
    params, runners, out = init_params(spec, 0), {}, []
    for label, slots, plan in shapes():
        if slots not in runners:
            prompts = np.zeros((slots, spec.max_len), np.int32)
            runners[slots] = Runner(spec, params, slots, prompts, np.full(slots, 1024, np.int32),
                                    mixed_rows=512)  # fmt: skip
        runner = runners[slots]
        shape = runner.buckets.shape_of(plan)
        runner.warmup([shape])
        run = lambda r=runner, p=plan, s=shape: r.execute(p, s)[0]  # noqa: E731
        out.append((label, plan, shape.rows * shape.tokens, best_time(run, repeats)))
    return out


def _terms(spec: ModelSpec, plan: Plan, computed: int) -> tuple[np.ndarray, np.ndarray]:
    """Each operation's (FLOPs, bytes): the matmuls (at `computed` tokens, the pass's padded
    shape) and LM head [K, 2], and attention [R, 2], one row per request."""
    fed = plan.num_tokens > 0
    flat = int(plan.kind) == MIXED
    work = pass_work(spec, plan.num_tokens[fed], plan.start_pos[fed], fed[fed], 1, computed, flat)
    rows = {op: np.stack([np.ravel(f), np.ravel(b)], -1).astype(np.float64)
            for op, (f, b) in work.items()}  # fmt: skip
    attention = rows.pop("attention")
    return np.concatenate(list(rows.values())), attention


def _padded(terms: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """[passes, width] FLOPs and bytes, zero-padded."""
    width = max(len(t) for t in terms)
    flops, nbytes = np.zeros((len(terms), width)), np.zeros((len(terms), width))
    for i, t in enumerate(terms):
        flops[i, : len(t)], nbytes[i, : len(t)] = t[:, 0], t[:, 1]
    return flops, nbytes


def fit(terms: list[tuple[np.ndarray, np.ndarray]], times: np.ndarray, bandwidth: float,
        peak: float):  # fmt: skip
    """(compute efficiency, memory efficiency, attention efficiency, overhead s) minimising the
    squared relative error of overhead + sum over operations of max(FLOPs / (peak x ce),
    bytes / (bandwidth x me)), attention's divided by its efficiency."""
    mm_flops, mm_bytes = _padded([m for m, _ in terms])
    at_flops, at_bytes = _padded([a for _, a in terms])
    best = (np.inf, 1.0, 1.0, 1.0, 0.0)
    grid = np.geomspace(0.002, 1.0, 120)
    attention_grid = np.geomspace(0.02, 2.0, 120)[:, None]
    w = 1 / times**2  # relative error: each pass weighs alike
    for ce in grid:
        for me in grid:
            matmul = np.maximum(mm_flops / (peak * ce), mm_bytes / (bandwidth * me)).sum(1)
            attention = np.maximum(at_flops / (peak * ce), at_bytes / (bandwidth * me)).sum(1)
            base = matmul + attention / attention_grid  # [attention efficiencies, passes]
            overhead = np.maximum(0.0, ((times - base) * w).sum(1) / w.sum())
            loss = (((base + overhead[:, None]) / times - 1) ** 2).sum(1)
            i = int(np.argmin(loss))
            if loss[i] < best[0]:
                best = (loss[i], float(ce), float(me), float(attention_grid[i, 0]), overhead[i])
    return tuple(float(x) for x in best[1:])


def predict(terms, bandwidth, peak, ce, me, ae, overhead) -> np.ndarray:
    def op_time(t):
        return np.maximum(t[:, 0] / (peak * ce), t[:, 1] / (bandwidth * me)).sum()

    return np.array([overhead + op_time(m) + op_time(a) / ae for m, a in terms])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=HARDWARE_DIR / "cpu_local.yaml")
    args = ap.parse_args(argv)
    spec = ModelConfig().spec()  # the tiny model, float32
    bandwidth, peak = machine()
    print(f"machine: read {bandwidth / 1e9:.1f} GB/s, matmul {peak / 1e9:.0f} GFLOP/s")
    timed = time_passes(spec, args.repeats)
    terms = [_terms(spec, plan, computed) for _, plan, computed, _ in timed]
    times = np.array([t for *_, t in timed])
    held = np.arange(len(timed)) % 4 == 3
    fitted = [t for t, h in zip(terms, held) if not h]
    ce, me, ae, overhead = fit(fitted, times[~held], bandwidth, peak)
    pred = predict(terms, bandwidth, peak, ce, me, ae, overhead)
    err = pred / times - 1
    print(f"fit: compute efficiency {ce:.3f}, memory efficiency {me:.3f}, attention efficiency "
          f"{ae:.3f}, overhead {overhead * 1e6:.0f} us")  # fmt: skip
    for (label, _, _, t), p, e, h in zip(timed, pred, err, held):
        print(f"  {label:<40}{1e3 * t:9.2f} ms  priced {1e3 * p:9.2f} ms  {e:+7.1%}"
              f"{'  (held out)' if h else ''}")  # fmt: skip
    print(f"median |error|: fitted shapes {np.median(np.abs(err[~held])):.1%}, "
          f"held-out shapes {np.median(np.abs(err[held])):.1%}")  # fmt: skip
    in_run = run_overhead(spec, bandwidth, peak, ce, me, ae)
    print(f"per-pass overhead in a real run (host loop): {in_run * 1e6:.0f} us; written")
    overhead = in_run
    memory_gb = _memory_gb()
    args.out.write_text(
        "# This machine, fitted by `jaxbatch-calibrate` to the tiny model's passes on the runner\n"
        f"# (float32, {jax.default_backend()}). Held-out median error "
        f"{np.median(np.abs(err[held])):.1%}.\n"
        f"name: cpu_local\npeak_tflops: {peak / 1e12:.6f}\nmemory_gb_s: {bandwidth / 1e9:.3f}\n"
        f"memory_gb: {memory_gb:.1f}\nlink_gb_s: 1.0  # one device: no all-reduce\n"
        f"compute_efficiency: {ce:.4f}\nmemory_efficiency: {me:.4f}\n"
        f"attention_efficiency: {ae:.4f}\npadded: true  # matmuls priced as the runner pads them\n"
        f"pass_overhead_us: {overhead * 1e6:.1f}\n"
    )
    print(f"wrote {args.out}")


def run_overhead(
    spec: ModelSpec, bandwidth: float, peak: float, ce: float, me: float, ae: float
) -> float:
    """Median over a real run's passes of the measured time less the priced work."""
    lengths = LengthConfig(dist="uniform", low=16, high=128)
    cfg = Config(
        workload=WorkloadConfig(num_requests=64, prompt=lengths, output=lengths),
        engine=EngineConfig(num_slots=16), output=OutputConfig(progress=False, plots=False),
    )  # fmt: skip
    rec = simulate(cfg, from_config(cfg.workload)).record
    plans = [
        Plan(rec.req[p], rec.num_tokens[p], rec.start_pos[p], np.int32(rec.kind[p]),
             np.float32(0), np.zeros((rec.num_slots, 0), np.int32))
        for p in range(rec.num_passes)
    ]  # fmt: skip
    computed = rec.rows * rec.row_tokens
    terms = [_terms(spec, plan, c) for plan, c in zip(plans, computed)]
    work = predict(terms, bandwidth, peak, ce, me, ae, 0.0)
    return max(0.0, float(np.median(rec.duration - work)))


def _memory_gb() -> float:
    """This machine's memory (Linux), else 16 GB."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return 16.0


if __name__ == "__main__":
    main()
