"""`jaxbatch-calibrate`: fit the cost model to this machine's runner, as hardware `cpu_local`.

It measures the machine (read bandwidth: a jitted sum over 64-256 MiB; peak: a jitted 2048 x 2048
float32 matmul), times the real runner's passes over a grid of shapes (decode: slots x context, and
as a run has them; prefill: prompts x tokens; mixed: decodes plus a prompt chunk filling a token
budget) in interleaved rounds, prices each pass's work with `cost_model.pass_work` at the runner's
padded shape (the entry's `padded`: matmuls on every row of the pass's bucket, attention over each
row's context bucket, `cost_model.runner_shape`), and fits the entry's compute, memory and
attention efficiencies, the share of an operation's shorter time (compute or memory) that the
longer hides (`overlap`), and an overhead per pass kind to the times by least squares on the
relative error. The entry written is the fit to every shape; it prints each shape's error under
it and under the fit that did not see the shape (4 folds, each every fourth shape), and the
medians: with every shape held out once, and with fold 3 alone held out. A pass in a run also
costs the host loop's own work (schedule, commit, one sync), which a pass timed alone does not,
and more for a pass that feeds prompt tokens (the loop dispatches a decode ahead of its plan,
never a prompt pass): the overheads written, one per pass kind, are medians over that kind's
passes in real runs (continuous and chunked) of each pass's measured time less its priced work
(`run_overheads`). It writes configs/hardware/cpu_local.yaml.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.backend.cost_model import Padded, op_time, pass_work, runner_shape
from jaxbatch.backend.runner import Runner
from jaxbatch.config import (
    Config,
    EngineConfig,
    LengthConfig,
    ModelConfig,
    OutputConfig,
    PolicyConfig,
    WorkloadConfig,
)
from jaxbatch.model.spec import ModelSpec
from jaxbatch.model.transformer import init_params
from jaxbatch.run import build_backend, memory_spec, simulate
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


def machine(repeats: int = 5, dtype: str = "float32") -> tuple[float, float]:
    """(read bytes/s, matmul FLOP/s): the best this process reaches, each from its fastest run;
    the matmul's inputs in `dtype`, accumulated in float32 (as the model's matmuls).
    A median counted this shared VM's slow moments against the limit: the same 2048 x 2048
    matmul's median read 233 and 307 GFLOP/s minutes apart, and passes then appeared faster
    than their roofline."""
    total = jax.jit(jnp.sum)
    bandwidth = 0.0
    for mib in (64, 256):
        x = jnp.ones(mib * 2**20 // 4, jnp.float32)
        bandwidth = max(bandwidth, mib * 2**20 / fastest(lambda x=x: total(x), 4 * repeats))
    a = jnp.ones((2048, 2048), dtype)
    matmul = jax.jit(lambda a: jax.lax.dot(a, a, preferred_element_type=jnp.float32))
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
    # As in a run: contexts of every length, and slots left empty (the runner pads both).
    spread = np.linspace(16, 255, 16).astype(np.int32)
    out.append(("decode 16, contexts 16..256", 16, _plan(DECODE, 1, spread, 16)))
    out.append(("decode 4 of 16 slots x 256", 16, _plan(DECODE, [1] * 4 + [0] * 12, 255, 16)))
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


def time_passes(spec: ModelSpec, repeats: int) -> list[tuple[str, Plan, Padded, float]]:
    """Each grid pass on the real runner: (label, plan, the runner's shape, median seconds).
    The grid is timed in `repeats` rounds, each pass once a round, so that every pass meets the
    machine's slow and fast moments alike: timed back to back, one shape's 15 runs fell in one
    moment of this shared VM, and the same shape's median moved by up to 60% between runs
    minutes apart, more than the cost model's error."""
    params, runners, passes = init_params(spec, 0), {}, []
    for label, slots, plan in shapes():
        if slots not in runners:
            prompts = np.zeros((slots, spec.max_len), np.int32)
            runners[slots] = Runner(spec, params, slots, prompts, np.full(slots, 1024, np.int32),
                                    mixed_rows=512)  # fmt: skip
        runner = runners[slots]
        shape = runner.buckets.shape_of(plan)
        runner.warmup([shape])
        run = lambda r=runner, p=plan, s=shape: r.execute(p, s)[0]  # noqa: E731
        jax.block_until_ready(run())  # its first run, apart
        passes.append((label, plan, runner_shape(runner.buckets, plan, np), run))
    times = [[] for _ in passes]
    for _ in range(repeats):
        for seconds, (*_, run) in zip(times, passes):
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            seconds.append(time.perf_counter() - t0)
    return [(*p[:3], statistics.median(t)) for p, t in zip(passes, times)]


def _terms(spec: ModelSpec, plan: Plan, padded: Padded) -> tuple[np.ndarray, np.ndarray]:
    """Each operation's (FLOPs, bytes) at the runner's shape of the pass (`padded`): the matmuls,
    own keys and LM head [K, 2], and attention [1, 2]."""
    fed = plan.num_tokens > 0
    work = pass_work(spec, plan.num_tokens[fed], plan.start_pos[fed], fed[fed], 1, padded)
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


KINDS = (DECODE, PREFILL, MIXED)  # each kind's overhead is its own
# The overlaps the fit tries. On this 2-core CPU it chose 0 (a sum) over 1 (the roofline's max)
# on five grids timed on 2026-12-06: fold-3 held-out error 4.9-18.1% against 6.3-21.4%.
OVERLAPS = (0.0, 0.25, 0.5, 0.75, 1.0)


def fit(terms: list[tuple[np.ndarray, np.ndarray]], times: np.ndarray, kinds: np.ndarray,
        bandwidth: float, peak: float):  # fmt: skip
    """(compute efficiency, memory efficiency, attention efficiency, overlap, decode overhead s,
    a prefill's extra s, a mixed pass's extra s) minimising the squared relative error of its
    kind's overhead (`kinds` [P]) + the sum over operations of `op_time`(FLOPs / (peak x ce),
    bytes / (bandwidth x me), overlap), attention's divided by its efficiency. A flat pass runs
    many more operations than a decode (tiles, blocks, gathers), so a kind's fixed cost is its
    own."""
    mm_flops, mm_bytes = _padded([m for m, _ in terms])
    at_flops, at_bytes = _padded([a for _, a in terms])
    best = (np.inf, 1.0, 1.0, 1.0, 1.0, np.zeros(len(KINDS)))
    grid = np.geomspace(0.002, 1.0, 120)
    memory = bandwidth * grid[:, None, None]  # every memory efficiency at once: [me, 1, 1]
    attention_grid = np.geomspace(0.02, 2.0, 120)[:, None]  # [ae, 1]
    w = 1 / times**2  # relative error: each pass weighs alike
    groups = np.stack([kinds == k for k in KINDS]).astype(np.float64)  # [kinds, passes]
    for overlap in OVERLAPS:
        for ce in grid:
            c = peak * ce
            matmul = op_time(mm_flops / c, mm_bytes / memory, overlap, np).sum(2)  # [me, P]
            attention = op_time(at_flops / c, at_bytes / memory, overlap, np).sum(2)
            base = matmul[:, None] + attention[:, None] / attention_grid  # [me, ae, P]
            # Each kind's overhead in closed form: its passes' weighted mean residual.
            overhead = ((times - base) * w) @ groups.T / np.maximum((groups * w).sum(1), 1e-30)
            overhead = np.maximum(0.0, overhead)  # [me, ae, kinds]
            loss = (((base + overhead @ groups) / times - 1) ** 2).sum(2)
            i, j = np.unravel_index(int(np.argmin(loss)), loss.shape)
            if loss[i, j] < best[0]:
                best = (loss[i, j], ce, grid[i], attention_grid[j, 0], overlap, overhead[i, j])
    _, ce, me, ae, overlap, (decode, prefill, mixed) = best
    return tuple(float(x) for x in (ce, me, ae, overlap, decode, prefill - decode, mixed - decode))


def predict(terms, kinds, bandwidth, peak, ce, me, ae, overlap, overhead, prefill,
            mixed) -> np.ndarray:  # fmt: skip
    """Each pass's price: `overhead`, `prefill` or `mixed` more for those kinds (`kinds` [P]),
    and its work."""

    def work(t):
        return op_time(t[:, 0] / (peak * ce), t[:, 1] / (bandwidth * me), overlap, np).sum()

    kinds = np.asarray(kinds)
    priced = np.array([work(m) + work(a) / ae for m, a in terms])
    return overhead + prefill * (kinds == PREFILL) + mixed * (kinds == MIXED) + priced


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=HARDWARE_DIR / "cpu_local.yaml")
    args = ap.parse_args(argv)
    spec = ModelConfig().spec()  # the tiny model, float32
    bandwidth, peak = machine()
    print(f"machine: read {bandwidth / 1e9:.1f} GB/s, matmul {peak / 1e9:.0f} GFLOP/s")
    timed = time_passes(spec, args.repeats)
    terms = [_terms(spec, plan, padded) for _, plan, padded, _ in timed]
    times = np.array([t for *_, t in timed])
    kinds = np.array([int(plan.kind) for _, plan, _, _ in timed])
    folds = np.arange(len(timed)) % 4  # fold k: every fourth shape from the k-th

    def held_out(k):  # each shape's error under the fit without fold k
        keep = folds != k
        got = fit([t for t, f in zip(terms, keep) if f], times[keep], kinds[keep], bandwidth,
                  peak)  # fmt: skip
        return predict(terms, kinds, bandwidth, peak, *got) / times - 1

    # Each shape's error under the fit that did not see it (4 folds), and that of fold 3 alone.
    cross = sum(np.where(folds == k, held_out(k), 0.0) for k in range(4))
    fourth = np.median(np.abs(cross[folds == 3]))
    ce, me, ae, overlap, *overheads = fit(terms, times, kinds, bandwidth, peak)  # the entry
    err = predict(terms, kinds, bandwidth, peak, ce, me, ae, overlap, *overheads) / times - 1
    print(
        f"fit to every shape (written): compute efficiency {ce:.3f}, memory efficiency {me:.3f}, "
        f"attention efficiency {ae:.3f}, overlap {overlap:g}, overhead {_us(overheads)}"
    )
    print(f"  {'shape':<40}{'measured':>12}{'priced':>12}{'error':>8}{'held out':>10}")
    for (label, _, _, t), e, c in zip(timed, err, cross):
        print(f"  {label:<40}{1e3 * t:9.2f} ms{1e3 * t * (1 + e):9.2f} ms{e:+8.1%}{c:+10.1%}")
    held = np.median(np.abs(cross))
    print(f"median |error|: the written fit {np.median(np.abs(err)):.1%}; held out, every shape "
          f"once (4 folds) {held:.1%}, every fourth shape (fold 3 only) {fourth:.1%}")  # fmt: skip
    overhead, prefill, mixed = run_overheads(spec, bandwidth, peak, ce, me, ae, overlap)
    print(f"overhead in real runs (host loop): {_us((overhead, prefill, mixed))}; written")
    memory_gb = _memory_gb()
    args.out.write_text(
        "# This machine, fitted by `jaxbatch-calibrate` to the tiny model's passes on the runner\n"
        f"# (float32, {jax.default_backend()}). Median error {np.median(np.abs(err)):.1%}; held "
        f"out, every shape once (4 folds) {held:.1%}, every fourth shape {fourth:.1%}.\n"
        f"name: cpu_local\npeak_tflops: {peak / 1e12:.6f}\nmemory_gb_s: {bandwidth / 1e9:.3f}\n"
        f"memory_gb: {memory_gb:.1f}\nlink_gb_s: 1.0  # one device: no all-reduce\n"
        f"compute_efficiency: {ce:.4f}\nmemory_efficiency: {me:.4f}\n"
        f"attention_efficiency: {ae:.4f}\noverlap: {overlap:g}\n"
        "padded: true  # priced at the runner's padded shapes\n"
        f"pass_overhead_us: {overhead * 1e6:.1f}\nprefill_overhead_us: {prefill * 1e6:.1f}\n"
        f"mixed_overhead_us: {mixed * 1e6:.1f}\n"
    )
    print(f"wrote {args.out}")


def _us(overheads) -> str:
    decode, prefill, mixed = (x * 1e6 for x in overheads)
    return f"decode {decode:.0f} us, prefill {prefill:+.0f} us more, mixed {mixed:+.0f} us more"


def run_overheads(
    spec: ModelSpec, bandwidth: float, peak: float, ce: float, me: float, ae: float,
    overlap: float, runs: int = 3,
) -> tuple[float, float, float]:  # fmt: skip
    """(decode overhead, a prefill's extra, a mixed pass's extra) in seconds, from real runs
    (continuous and chunked, 64 requests, workload seed 1: not the fidelity benchmark's, each
    `runs` times, interleaved): per kind, the median over the runs of the median over its passes
    of each one's measured time less its priced work; the extras less the decode's. A decode is
    dispatched ahead of its plan, so the host's work hides behind the pass before it; a prompt
    pass waits for its plan. One run each read a decode overhead of 2,041 us where three fresh
    processes read 832-870 us minutes later (2026-12-07): this VM slows for seconds at a time,
    so one run is not enough."""
    lengths = LengthConfig(dist="uniform", low=16, high=128)
    per_run = []  # (residuals, kinds) of each run
    for policy in ("continuous", "chunked") * runs:
        cfg = Config(
            policy=PolicyConfig(name=policy),
            workload=WorkloadConfig(num_requests=64, prompt=lengths, output=lengths, seed=1),
            engine=EngineConfig(num_slots=16), output=OutputConfig(progress=False, plots=False),
        )  # fmt: skip
        workload = from_config(cfg.workload)
        rec = simulate(cfg, workload).record
        # The run's buckets: the simulator's for the same config are the runner's (tested).
        simulated = dataclasses.replace(cfg.engine, backend="simulator", clock="passes")
        buckets = build_backend(dataclasses.replace(cfg, engine=simulated), workload,
                                memory_spec(cfg)).buckets  # fmt: skip
        residual = []
        for p in range(rec.num_passes):
            plan = Plan(rec.req[p], rec.num_tokens[p], rec.start_pos[p], np.int32(rec.kind[p]),
                        np.float32(0), np.zeros((rec.num_slots, 0), np.int32))  # fmt: skip
            terms = _terms(spec, plan, runner_shape(buckets, plan, np))
            work = predict([terms], [DECODE], bandwidth, peak, ce, me, ae, overlap, 0.0, 0.0,
                           0.0)[0]  # fmt: skip
            residual.append(rec.duration[p] - work)
        per_run.append((np.array(residual), rec.kind))
    decode, prefill, mixed = (
        max(0.0, float(np.median([np.median(r[kind == k]) for r, kind in per_run
                                  if (kind == k).any()])))
        for k in KINDS
    )  # fmt: skip
    return decode, prefill - decode, mixed - decode


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
