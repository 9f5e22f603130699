"""The simulator's device loop: a whole schedule-only run (schedule, price, commit, record) as one
`lax.while_loop`, for every policy and any arrival process.

Each iteration schedules at the loop's clock; an idle plan moves the clock to its `wait_until`
(the host loop's jump), any other plan is a pass: it is charged one unit (the `passes` clock) or
its price (`priced`), every fed slot's token is 0, and the commit ends requests by their output
budget. The plans are the host loop's, since both call the same `schedule` and `commit` in the same
order (a test holds them equal for every policy). A run goes in segments of about SEGMENT_S
seconds, between which the host reads Ctrl-C and advances the progress bar. The clock is float32
on the device: exact for pass counts up to 2^24 and for priced times to float32's step (a
microsecond up to 8 s); the host loop keeps float64 times. Results come back at the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxbatch.backend.compilation import cache_hits, num_compiles
from jaxbatch.backend.simulator import Simulator
from jaxbatch.engine import RunResult, kv_live, kv_reserved
from jaxbatch.interrupt import never
from jaxbatch.report.recorder import Record, emitted
from jaxbatch.sched.policies import Policy, PolicyParams
from jaxbatch.sched.state import FINISHED, IDLE, REJECTED, Plan, SchedState

SEGMENT_S = 0.25  # run_device's segments last about this long: Ctrl-C is read between them
BUFFER = 1 << 16  # passes of record run_device keeps on the device between two drains


def _start(state: SchedState, max_passes: int):
    """The loop's first carry: state, passes run, clock, done, and an empty record."""
    b = state.num_slots
    grid = jnp.full((max_passes, b), -1, jnp.int32)
    zeros = jnp.zeros(max_passes, jnp.float32)
    rec = {
        "req": grid, "num_tokens": grid * 0, "start_pos": grid * 0, "holder": grid,
        "kind": jnp.zeros(max_passes, jnp.int32), "start": zeros, "duration": zeros,
        "kv": jnp.zeros(max_passes, jnp.int32), "granted": jnp.zeros(max_passes, jnp.int32),
    }  # fmt: skip
    return state, jnp.int32(0), jnp.float32(0.0), jnp.bool_(False), rec


def _step(policy: Policy, params: PolicyParams, price, max_passes: int, carry):
    """One iteration: schedule at the clock; an idle plan moves the clock, any other runs a pass.
    A finished run (or one at max_passes) is left as it is, so members of a sweep can step on
    together until the last ends."""
    st0, p, now0, done0, rec = carry
    halted = done0 | (p >= max_passes)
    st, plan = policy.schedule(st0.replace(now=now0), params)
    idle = plan.kind == IDLE
    cost = jnp.float32(1.0) if price is None else price(plan).astype(jnp.float32)
    holder = st.slot_req
    committed = policy.commit(st, plan, jnp.zeros(st.num_slots, jnp.int32), params)
    kv, granted = kv_live(committed, holder), kv_reserved(committed)
    row = {"req": plan.req, "num_tokens": plan.num_tokens, "start_pos": plan.start_pos,
           "holder": holder, "kind": plan.kind, "start": now0, "duration": cost, "kv": kv,
           "granted": granted}  # fmt: skip
    at = jnp.where(idle | halted, max_passes, p)  # an idle plan records nothing
    rec = {k: rec[k].at[at].set(v, mode="drop") for k, v in row.items()}
    st = jax.tree.map(lambda a, c: jnp.where(idle, a, c), st, committed)
    now = jnp.where(idle, jnp.maximum(now0, plan.wait_until), now0 + cost)
    done = idle & ~jnp.isfinite(plan.wait_until)
    keep = lambda old, new: jax.tree.map(lambda o, n: jnp.where(halted, o, n), old, new)  # noqa: E731
    st, now, done = keep(st0, st), keep(now0, now), done0 | done
    return st, p + (~idle & ~halted).astype(jnp.int32), now, done, rec


def _live(max_passes: int, carry):
    _, p, _, done, _ = carry
    return ~done & (p < max_passes)


def device_loop(
    policy: Policy,
    params: PolicyParams,
    state: SchedState,
    price: Callable[[Plan], jax.Array] | None,
    max_passes: int,
):
    """The loop as a pure function of (params, state): returns the final state, the passes run
    and the record's arrays. `price` None charges a pass one unit. Jittable; for many runs at
    once use `sweep_loop` (a vmapped while_loop would copy every member's record each pass)."""
    step = partial(_step, policy, params, price, max_passes)
    st, p, _, _, rec = jax.lax.while_loop(partial(_live, max_passes), step,
                                          _start(state, max_passes))  # fmt: skip
    return st, p, rec


def sweep_loop(
    policy: Policy,
    params: PolicyParams,
    states: SchedState,
    price: Callable[[Plan], jax.Array] | None,
    max_passes: int,
):
    """`device_loop` for a batch of runs (`states` stacked on a leading axis, as for vmap): one
    while_loop whose body steps every member (vmapped), until the last ends. Member i equals
    `device_loop` on states[i], field for field."""
    step = jax.vmap(partial(_step, policy, params, price, max_passes))
    start = jax.vmap(partial(_start, max_passes=max_passes))(states)
    st, p, _, _, rec = jax.lax.while_loop(
        lambda c: jax.vmap(partial(_live, max_passes))(c).any(), step, start
    )
    return st, p, rec


def run_device(
    policy: Policy,
    params: PolicyParams,
    state: SchedState,
    backend: Simulator,
    max_passes: int,
    progress: bool = False,
    stop: Callable[[], bool] = never,
) -> RunResult:
    """A simulated run through the device loop, in segments (`stop()` is read between them),
    timed as a whole; its record as the host loop's (computed tokens from the simulator's
    buckets, as the host loop counts them). The device holds the record of at most BUFFER passes:
    the host drains it whenever it fills, so memory follows the passes run, not `max_passes`."""
    size = min(max_passes, BUFFER)
    step = partial(_step, policy, params, backend.price_plan, size)

    def segment(carry, end):
        return jax.lax.while_loop(lambda c: _live(size, c) & (c[1] < end), step, carry)

    compiles0, hits0, t0 = num_compiles(), cache_hits(), time.perf_counter()
    carry = jax.jit(partial(_start, max_passes=size))(state)
    run = jax.jit(segment, donate_argnums=0).lower(carry, jnp.int32(0)).compile()
    warmup_s, t0 = time.perf_counter() - t0, time.perf_counter()
    compiles_warm = num_compiles()
    live = np.asarray(state.status) != REJECTED
    bar = tqdm(total=int(np.asarray(state.max_new)[live].sum()), disable=not progress,
               unit="tok", desc=policy.name, leave=False)  # fmt: skip
    drained: list[dict] = []  # host copies of full buffers
    p, total, length = 0, 0, 64  # p: passes in the buffer; total: passes before it

    def drain(carry, p):
        drained.append({k: np.asarray(v[:p]) for k, v in jax.device_get(carry[4]).items()})
        return (carry[0], jnp.int32(0), *carry[2:])

    while not stop():
        t_segment = time.perf_counter()
        carry = run(carry, jnp.int32(min(p + length, size)))
        p_next, done = int(carry[1]), bool(carry[3])  # waits for the segment
        if progress:
            bar.n = int(np.asarray(carry[0].num_generated).sum())
            bar.refresh()
        seconds = time.perf_counter() - t_segment
        length = int(np.clip(SEGMENT_S * (p_next - p + 1) / max(seconds, 1e-6), 64, 1 << 20))
        p = p_next
        if done or total + p >= max_passes:
            break
        if p == size:
            carry, total, p = drain(carry, p), total + p, 0
    wall_s = time.perf_counter() - t0
    bar.close()
    carry = drain(carry, p)
    final = jax.device_get(carry[0])
    p = total + p
    unfinished = bool(((final.status != FINISHED) & (final.status != REJECTED)).any())
    interrupted = unfinished and stop()
    if unfinished and not interrupted:
        raise RuntimeError(f"the device loop did not end within max_passes={max_passes}")
    rows = {k: np.concatenate([d[k] for d in drained]) for k in drained[0]}
    plans = [
        Plan(
            rows["req"][i],
            rows["num_tokens"][i],
            rows["start_pos"][i],
            rows["kind"][i],
            np.float32(0),
            np.zeros((state.num_slots, 0), np.int32),
        )
        for i in range(p)
    ]
    computed = [backend.buckets.shape_of(plan) for plan in plans]
    record = Record(
        start=rows["start"].astype(np.float64), duration=rows["duration"].astype(np.float64),
        kind=rows["kind"], req=rows["req"], num_tokens=rows["num_tokens"],
        start_pos=rows["start_pos"], holder=rows["holder"],
        emits=emitted(rows["req"], rows["num_tokens"], rows["start_pos"],
                      np.asarray(final.prompt_len)),
        computed_tokens=np.array([s.rows * s.tokens for s in computed], np.int64),
        kv_tokens=rows["kv"].astype(np.int64), kv_reserved=rows["granted"].astype(np.int64),
    )  # fmt: skip
    end = float(record.start[-1] + record.duration[-1]) if p else 0.0
    return RunResult(
        record=record, final=final, outputs=None, logits=None, duration_s=end,
        warmup_s=warmup_s, num_compiles=num_compiles() - compiles0,
        compiles_after_warmup=num_compiles() - compiles_warm, cache_hits=cache_hits() - hits0,
        wall_s=wall_s, interrupted=interrupted,
    )  # fmt: skip
