"""A run built in one place: a config and a workload in, a `RunResult` out.

Memory spec, up-front rejections, scheduler state, backend, policy and loop are chosen here, for
the command line, tests, benchmarks and experiments alike. Bad input raises ConfigError naming the
field; nothing here writes files (see `cli`).
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from omegaconf import OmegaConf

from jaxbatch.backend.buckets import PassShape, pow2_at_least
from jaxbatch.backend.compilation import cache_dir, use_cache
from jaxbatch.backend.cost_model import (
    ACTIVATION_RESERVE,
    Hardware,
    kv_budget_tokens,
    weight_bytes,
)
from jaxbatch.backend.runner import Runner, Sampling
from jaxbatch.backend.runner_step import RunnerStep
from jaxbatch.backend.sharding import compact_decodes, make_mesh, replicated
from jaxbatch.backend.simulator import Simulator
from jaxbatch.config import BUDGETED_POLICIES, Config, ConfigError, resolve_auto
from jaxbatch.device_loop import run_device
from jaxbatch.engine import RunResult, fixed_plans, plan_warmup, run
from jaxbatch.interrupt import never
from jaxbatch.model.checkpoint import TrainedCheckpointError, load_trained
from jaxbatch.model.hf import CheckpointError, load_params
from jaxbatch.model.kvcache import min_read
from jaxbatch.model.transformer import init_params, stored
from jaxbatch.resume import Checkpoints
from jaxbatch.sched.blocks import MemorySpec
from jaxbatch.sched.policies import Policy, PolicyParams, make_policy
from jaxbatch.sched.state import SchedState, init_state
from jaxbatch.sweep_loop import run_sweep
from jaxbatch.workload import Workload


def hardware(cfg: Config) -> Hardware | None:
    """The target hardware of `cfg.hardware` (None: none)."""
    h = cfg.hardware
    if h.name == "none":
        return None
    return Hardware(
        h.name, h.peak_tflops * 1e12, h.memory_gb_s * 1e9, h.memory_gb * 1e9, h.link_gb_s * 1e9,
        h.compute_efficiency, h.memory_efficiency, h.pass_overhead_us * 1e-6,
        h.attention_efficiency, h.padded, h.prefill_overhead_us * 1e-6, h.mixed_overhead_us * 1e-6,
        h.overlap,
    )  # fmt: skip


def memory_spec(cfg: Config) -> MemorySpec:
    """The KV budget in positions: budget_tokens, else budget_mib, else what the target hardware
    holds beside the weights, else one max_len per slot."""
    spec, mem, hw = cfg.model.spec(), cfg.memory, hardware(cfg)
    if mem.budget_tokens:
        tokens = mem.budget_tokens
    elif mem.budget_mib:
        tokens = int(mem.budget_mib * 2**20 // spec.kv_bytes_per_token)
    elif hw is not None:
        tokens = _hardware_budget(cfg, spec, hw)
    else:
        tokens = cfg.engine.num_slots * spec.max_len
    return MemorySpec(tokens, spec.max_len, mem.layout, mem.reservation, mem.block_size)


def rejections(cfg: Config, workload: Workload, memory: MemorySpec) -> list[str]:
    """Why each request can never run ('' if it can). Stops the run with ConfigError when the
    budget cannot hold even the smallest request, naming the smallest budget that would."""
    spec = cfg.model.spec()
    reasons = workload.rejections(spec.max_len)
    need = np.asarray(memory.whole_need(workload.prompt_len, workload.max_new))
    fits_model = np.array([not r for r in reasons])
    if fits_model.any() and need[fits_model].min() > memory.capacity_tokens:
        mib = lambda tokens: tokens * spec.kv_bytes_per_token / 2**20  # noqa: E731
        smallest, largest = need[fits_model].min(), need[fits_model].max()
        by_tokens = bool(cfg.memory.budget_tokens)
        raise ConfigError(
            "memory.budget_tokens" if by_tokens else "memory.budget_mib",
            cfg.memory.budget_tokens if by_tokens else cfg.memory.budget_mib,
            f"it holds {memory.capacity_tokens} KV positions but the smallest request needs "
            f"{smallest}: use at least {mib(smallest):.4f} MiB (budget_tokens={smallest}); "
            f"{mib(largest):.4f} MiB fits every request",
        )  # fmt: skip
    for i in np.flatnonzero(fits_model & (need > memory.capacity_tokens)):
        reasons[i] = f"needs {need[i]} KV positions, the budget holds {memory.capacity_tokens}"
    if memory.paged:
        _admission_rejections(cfg, workload, memory, reasons)
    if cfg.policy.name == "orca":  # orca never splits a prompt: one over the budget never runs
        budget = cfg.policy.token_budget
        for i in np.flatnonzero(workload.prompt_len > budget):
            reasons[i] = reasons[i] or (
                f"prompt_len {workload.prompt_len[i]} > orca's policy.token_budget {budget}"
            )
    return reasons


def _hardware_budget(cfg: Config, spec, hw: Hardware) -> int:
    """KV positions the devices hold beside the weights; a model that does not fit is refused."""
    tp = cfg.hardware.tensor_parallel
    tokens = kv_budget_tokens(spec, hw, tp)
    if tokens < spec.max_len:
        weights = weight_bytes(spec) / 1e9
        need = int(np.ceil(weights / (hw.memory_bytes * (1 - ACTIVATION_RESERVE) / 1e9)))
        raise ConfigError(
            "hardware.tensor_parallel", tp,
            f"{cfg.model.name}'s weights ({weights:.1f} GB) and one max_len sequence of KV do not "
            f"fit {tp} x {hw.memory_bytes / 1e9:g} GB of {hw.name} (less a "
            f"{ACTIVATION_RESERVE:.0%} activation reserve): use at least {max(need, tp + 1)} "
            "devices, a larger hardware, or a memory budget",
        )  # fmt: skip
    return tokens


def watermark_blocks(cfg: Config, memory: MemorySpec) -> int:
    """Blocks that admission leaves free (paged memory)."""
    return int(cfg.memory.watermark * memory.num_blocks)


def _admission_rejections(
    cfg: Config, workload: Workload, memory: MemorySpec, reasons: list[str]
) -> None:
    """Paged admission grants a prompt's blocks only while `memory.watermark` of the pool stays
    free: a prompt needing more than the rest can never be admitted, even into an empty pool.
    Stops the run (naming memory.watermark) when no request could ever be admitted; otherwise
    rejects, with the reason, each request that could not."""
    keep = watermark_blocks(cfg, memory)
    room = (memory.num_blocks - keep) * memory.block_size
    need = np.asarray(memory.need(workload.prompt_len, workload.max_new))
    ok = np.array([not r for r in reasons])
    if not ok.any():
        return
    if need[ok].min() > room:
        most = (memory.num_blocks - need[ok].min() // memory.block_size) / memory.num_blocks
        raise ConfigError(
            "memory.watermark", cfg.memory.watermark,
            f"it keeps {keep} of {memory.num_blocks} blocks free, so admission may grant "
            f"{room} KV positions, but the smallest prompt needs {need[ok].min()}: use at most "
            f"{most:.4f}",
        )  # fmt: skip
    for i in np.flatnonzero(ok & (need > room)):
        reasons[i] = (
            f"its prompt needs {need[i]} KV positions, admission may grant {room} "
            f"(memory.watermark={cfg.memory.watermark} keeps {keep} blocks free)"
        )


def eos_id(cfg: Config) -> int:
    """The token that ends a request: none with engine.ignore_eos, else engine.eos_id, else the
    model's (a checkpoint's config.json names it; not on the simulator, whose tokens are all
    0); -1: none."""
    e = cfg.engine
    model_eos = cfg.model.eos_id if e.backend == "runner" else -1
    return -1 if e.ignore_eos else e.eos_id if e.eos_id >= 0 else model_eos


def model_params(cfg: Config) -> dict:
    """The model's weights: a Hugging Face checkpoint's (`model.path`), a trained one's
    (`model.checkpoint`), else random from `model.seed`; stored in `model.dtype`
    (`transformer.stored`)."""
    spec = cfg.model.spec()
    if cfg.model.checkpoint:
        try:
            return jax.device_put(stored(spec, load_trained(cfg.model.checkpoint, spec)))
        except TrainedCheckpointError as err:
            raise ConfigError("model.checkpoint", cfg.model.checkpoint, str(err)) from None
    if not cfg.model.path:
        return init_params(spec, cfg.model.seed)
    try:
        return stored(spec, load_params(cfg.model.path, spec))
    except CheckpointError as err:
        raise ConfigError("model.path", cfg.model.path, str(err)) from None


def build_backend(cfg: Config, workload: Workload, memory: MemorySpec, with_logits: bool = False):
    e, spec = cfg.engine, cfg.model.spec()
    resolve_auto(cfg)  # engine.clock and engine.loop `auto`: the backend's own
    mixed_rows = 0  # the most rows of a mixed pass: the token budget's bucket
    if cfg.policy.name in BUDGETED_POLICIES:
        mixed_rows = pow2_at_least(cfg.policy.token_budget, e.min_bucket, 1 << 30)
    if e.backend == "simulator":
        priced = (hardware(cfg), cfg.hardware.tensor_parallel) if e.clock == "priced" else None
        compact = compact_decodes(e.decode_rows == "compact", data=cfg.mesh.data)
        return Simulator(e.num_slots, spec.max_len, e.min_bucket, mixed_rows, spec, priced,
                         min_read(spec.max_len, memory.paged), compact)  # fmt: skip
    return Runner(
        spec, model_params(cfg), e.num_slots,
        workload.prompts(spec.vocab_size, spec.max_len), workload.prompt_len, workload.ids,
        Sampling(e.temperature, e.top_k, e.seed), with_logits, e.min_bucket, memory, mixed_rows,
        make_mesh(cfg.mesh.data, cfg.mesh.model) if cfg.mesh.data * cfg.mesh.model > 1 else None,
        compact=e.decode_rows == "compact",
    )  # fmt: skip


def _prepare(cfg: Config, workload: Workload, with_logits: bool = False):
    """Everything a run needs: (policy, params, state, backend, memory, shapes, fed), where
    `shapes` is every pass shape the workload can use (what the loops warm up where no dry run
    knows the plans) and `fed` the tokens the run's passes feed at most."""
    e = cfg.engine
    use_cache(cache_dir(e.compile_cache))
    memory = memory_spec(cfg)
    rejected = np.array([bool(r) for r in rejections(cfg, workload, memory)])
    held = lambda x: np.where(rejected, 0, x)  # noqa: E731  (a rejected length may not fit int32)
    state = init_state(
        workload.arrival, held(workload.prompt_len), held(workload.max_new), rejected,
        e.num_slots, workload.priority, memory,
    )  # fmt: skip
    backend = build_backend(cfg, workload, memory, with_logits)
    if getattr(backend, "mesh", None) is not None:  # the scheduler's arrays: on every device
        state = jax.device_put(state, replicated(backend.mesh))
    ok = ~rejected
    shapes = backend.buckets.for_workload(
        workload.prompt_len[ok], workload.max_new[ok], recompute=memory.paged
    )
    watermark = watermark_blocks(cfg, memory)
    p = cfg.policy
    params = PolicyParams(
        max_wait_s=np.float32(p.max_wait_s), eos_id=np.int32(eos_id(cfg)),
        watermark_blocks=np.int32(watermark), token_budget=np.int32(p.token_budget),
        threshold=np.int32(p.long_prefill_threshold),
        max_prefills=np.int32(p.max_partial_prefills),
    )  # fmt: skip
    policy = make_policy(p.name, p.queue)
    fed = int((workload.prompt_len + workload.max_new)[ok].sum())
    return policy, params, state, backend, memory, shapes, fed


def _max_passes(fed: int, memory: MemorySpec) -> int:
    """Each pass feeds at least one token, and a preempted request recomputes at most its whole
    sequence once per preemption: a generous bound that still ends a stuck run."""
    return (4 if memory.paged else 1) * fed + 16


def runner_step(
    runner: Runner, policy: Policy, params: PolicyParams, state: SchedState, arrival: np.ndarray,
    every: list[PassShape],
) -> tuple[RunnerStep, bool]:  # fmt: skip
    """The runner's device-loop step, compiled for the shapes the host loop would warm up: where
    a run's plans are fixed (`fixed_plans`: the runner's device loop counts passes, so unless
    EOS ends requests), those a dry run of the host loop meets, the rare ones raised
    (`plan_warmup`: realistic continuous, `benchmarks/throughput.py`'s workload, 12 shapes);
    else `every` shape the workload can use (`Buckets.for_workload`). Returns the step and
    whether a dry run chose its shapes."""
    planned = None
    if fixed_plans(state, params, "passes"):
        planned = plan_warmup(policy, params, state, runner, arrival)
    return RunnerStep(runner, every if planned is None else planned), planned is not None


def simulate(
    cfg: Config, workload: Workload, with_logits: bool = False, stop: Callable[[], bool] = never,
    checkpoint_dir: Path | None = None,
) -> RunResult:  # fmt: skip
    """Run a validated config on a workload; requests that can never fit are rejected up front.
    The run ends early, with what it did, once `stop()` says so (see `interrupt`). A host-loop
    run with `checkpoint_dir` saves its checkpoints there (`output.checkpoint_every`, and where
    `stop()` ends it); with `cfg.resume` it continues from that run's latest (resume.py)."""
    e = cfg.engine
    policy, params, state, backend, memory, shapes, fed = _prepare(cfg, workload, with_logits)
    if e.loop == "device":
        if not isinstance(backend, Runner):
            return run_device(
                policy, params, state, backend, _max_passes(fed, memory), e.clock,
                cfg.output.progress, stop, workload.arrival,
            )  # fmt: skip
        t0 = time.perf_counter()
        step, planned = runner_step(backend, policy, params, state, workload.arrival, shapes)
        planning = time.perf_counter() - t0  # the dry run: warm-up too
        result = run_device(
            policy, params, state, step, _max_passes(fed, memory), e.clock,
            cfg.output.progress, stop, workload.arrival,
        )  # fmt: skip
        step.check(result.record)
        return dataclasses.replace(
            result, warmup_s=result.warmup_s + planning, warmup_planned=planned
        )
    checkpoints = None
    if checkpoint_dir is not None:
        yaml = OmegaConf.to_yaml(OmegaConf.structured(dataclasses.replace(cfg, resume="")))
        checkpoints = Checkpoints(checkpoint_dir, cfg.output.checkpoint_every, yaml)
    result = run(
        policy, params, state, backend,
        shapes if e.warmup and e.backend == "runner" else [],  # the simulator compiles no pass
        e.clock, cfg.output.progress,
        arrival=workload.arrival, stop=stop, checkpoints=checkpoints,
        resume_from=Path(cfg.resume) / "checkpoint" if cfg.resume else None,
    )  # fmt: skip
    if checkpoint_dir is not None and not result.interrupted:  # a finished run needs none
        shutil.rmtree(checkpoint_dir, ignore_errors=True)
    return result


def sweep_key(cfg: Config) -> str | None:
    """Runs with the same key can be simulated as one program (`simulate_sweep`): simulated on the
    device loop, with everything equal but their workloads (seed, arrival process and rate,
    lengths, trace scaling: same request count), output options, the policy's traced knobs
    (PolicyParams: token budget, long-prefill threshold, partial prefills, max_wait_s, eos_id,
    watermark) and, with paged memory, the budget (a pool sized for the largest, each member's
    usable blocks in its state). None: the run cannot join."""
    e, p, m = cfg.engine, cfg.policy, cfg.memory
    if e.backend != "simulator" or e.loop != "device":
        return None
    knobs = dict(token_budget=0, long_prefill_threshold=0, max_partial_prefills=0, max_wait_s=0.0)
    budget = dict(budget_tokens=0, budget_mib=0.0) if m.layout == "paged" else {}
    return repr(dataclasses.replace(
        cfg, workload=None, output=None, policy=dataclasses.replace(p, **knobs),
        engine=dataclasses.replace(e, eos_id=0, ignore_eos=False),
        memory=dataclasses.replace(m, watermark=0.0, **budget),
    ))  # fmt: skip


def simulate_sweep(cfgs: list[Config], workloads: list[Workload]) -> list[RunResult]:
    """Validated configs of one `sweep_key`, each with its workload, as one program
    (`sweep_loop.run_sweep`); each result equals its `simulate` (tested field for field)."""
    keys = {sweep_key(c) for c in cfgs}
    if len(keys) != 1 or None in keys or len({len(w) for w in workloads}) != 1:
        raise ValueError("simulate_sweep: runs of one sweep_key, with workloads of one length")
    members = [_prepare(c, w) for c, w in zip(cfgs, workloads)]
    policy, params, states, backends, memories, _, fed = zip(*members)
    pool = max(memories, key=lambda mem: mem.budget_tokens)  # equal, unless paged
    if pool.paged:  # every member on the largest pool, its own blocks usable
        states = [
            st.replace(memory=pool, block_free=np.arange(pool.num_blocks) < mem.num_blocks)
            for st, mem in zip(states, memories)
        ]  # fmt: skip
    passes = max(_max_passes(f, pool) for f in fed)
    return run_sweep(policy[0], list(params), list(states), list(backends), passes)
