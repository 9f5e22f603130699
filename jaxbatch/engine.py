"""The loop: schedule -> execute -> commit, on the host, one iteration per forward pass.

The clock advances by each iteration's measured wall time (schedule + execute + commit), or by one
unit per pass with the `passes` clock; when nothing can run it jumps to the policy's wake time, so
runs never sleep. Warm-up compiles everything before the clock starts. No metrics or I/O here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cache
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from tqdm.auto import tqdm

from jaxbatch.backend.buckets import PassShape, num_compiles
from jaxbatch.report.recorder import Record, Recorder
from jaxbatch.sched.policies import Policy, PolicyParams
from jaxbatch.sched.state import IDLE, Plan, SchedState


class Backend(Protocol):
    buckets: object

    def warmup(self, shapes: list[PassShape]) -> None: ...
    def execute(self, plan: Plan) -> tuple[Array, Array | None]: ...
    def outputs(self, num_generated: np.ndarray) -> list[np.ndarray] | None: ...


@dataclass(frozen=True)
class RunResult:
    record: Record
    final: SchedState  # host (numpy) copy of the last state
    outputs: list[np.ndarray] | None  # per request output token ids (None: simulated)
    logits: list[np.ndarray] | None  # per pass [B, V], only when the backend returns them
    duration_s: float  # the clock at the end of the last pass
    warmup_s: float
    num_compiles: int  # compilations during warm-up and run
    compiles_after_warmup: int
    wall_s: float  # host wall time of the loop


@cache
def _with_stats(commit):
    """commit, also returning each slot's holder and the KV positions in use (one jitted call)."""

    def commit_and_measure(state, plan, tokens, params):
        state = commit(state, plan, tokens, params)
        held = state.slot_req >= 0
        kv = jnp.where(held, state.num_computed[jnp.maximum(state.slot_req, 0)], 0).sum()
        return state, (state.slot_req, kv)

    return commit_and_measure


def run(
    policy: Policy,
    params: PolicyParams,
    state: SchedState,
    backend: Backend,
    warmup_shapes: list[PassShape],
    clock: str = "measured",
    progress: bool = False,
    max_passes: int = 10_000_000,
) -> RunResult:
    schedule = jax.jit(policy.schedule)
    commit = jax.jit(_with_stats(policy.commit))
    compiles0, t0 = num_compiles(), time.perf_counter()
    warm_state, warm_plan = schedule(state, params)
    jax.block_until_ready(commit(warm_state, warm_plan, jnp.zeros_like(warm_plan.req), params))
    backend.warmup(warmup_shapes)
    warmup_s = time.perf_counter() - t0
    compiles_warm = num_compiles()

    prompt_len = np.asarray(state.prompt_len)
    recorder = Recorder(prompt_len)
    logits: list[np.ndarray] = []
    live = np.asarray(state.status) != 4  # REJECTED
    bar = tqdm(
        total=int(np.asarray(state.max_new)[live].sum()), disable=not progress, unit="tok",
        desc=policy.name, leave=False,
    )  # fmt: skip
    now = 0.0
    loop_start = time.perf_counter()
    for _ in range(max_passes):
        t_start = time.perf_counter()
        state, plan = schedule(state.replace(now=np.float32(now)), params)
        plan_h = jax.device_get(plan)
        if int(plan_h.kind) == IDLE:
            if not np.isfinite(plan_h.wait_until):
                break
            now = max(now, float(plan_h.wait_until))
            continue
        tokens, pass_logits = backend.execute(plan_h)
        state, (holder, kv) = commit(state, plan, tokens, params)
        holder, kv = jax.device_get((holder, kv))
        if pass_logits is not None:
            logits.append(np.asarray(pass_logits))
        dt = time.perf_counter() - t_start if clock == "measured" else 1.0
        shape = backend.buckets.shape_of(plan_h)
        bar.update(recorder.add(now, dt, plan_h, holder, shape.rows * shape.tokens, int(kv)))
        now += dt
    else:
        raise RuntimeError(f"the run did not end within max_passes={max_passes}")
    wall_s = time.perf_counter() - loop_start
    bar.close()
    final = jax.device_get(state)
    return RunResult(
        record=recorder.finish(state.num_slots),
        final=final,
        outputs=backend.outputs(np.asarray(final.num_generated)),
        logits=logits or None,
        duration_s=now,
        warmup_s=warmup_s,
        num_compiles=num_compiles() - compiles0,
        compiles_after_warmup=num_compiles() - compiles_warm,
        wall_s=wall_s,
    )
