"""The device loop: a whole run (schedule, backend step, commit, record) as one `lax.while_loop`,
for both backends and any arrival process.

Each iteration schedules at the loop's clock; an idle plan moves the clock to its `wait_until`
(the host loop's jump), any other plan is a pass: the backend's `device_step` runs it (the
simulator prices it, `backend.simulator`; the runner runs its model, `backend.runner_step`) and
returns each slot's token and the pass's duration; the commit, the record and the clock follow.
The plans are the host loop's, since both call the same `schedule` and `commit` in the same order
(tests hold them equal for every policy, and the runner's tokens too).

A run goes in segments of about SEGMENT_S seconds, between which the host reads Ctrl-C and
advances the progress bar; the device keeps at most BUFFER passes of record, drained to the host
when full. The clock is float32 on the device: exact for pass counts up to 2^24; priced seconds
are relative to an origin the host moves between segments (`clock.Clock`, as the host loop), so
they stay exact to a microsecond at any time. A sweep's members (`sweep_loop.run_sweep`) keep a
plain float32 clock (a microsecond up to 8 s). On the runner, the clock counts passes; with
`clock=measured` (offline runs) the host times the whole loop and each pass is given the mean.
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
from jaxbatch.backend.executables import compile_now, compiled
from jaxbatch.backend.runner_step import RunnerStep
from jaxbatch.backend.simulator import Simulator
from jaxbatch.clock import WINDOW, Clock
from jaxbatch.engine import RunResult, kv_live, kv_reserved
from jaxbatch.interrupt import never
from jaxbatch.report.recorder import PASS_FIELDS, SLOT_FIELDS, from_columns, pass_row
from jaxbatch.sched.policies import Policy, PolicyParams, built_in
from jaxbatch.sched.state import FINISHED, IDLE, REJECTED, SchedState

_INF = float("inf")
SEGMENT_S = 0.25  # run_device's segments last about this long: Ctrl-C is read between them
# Passes of record run_device keeps on the device between two drains. A run allocates and fills
# it before its first pass: at 1 << 16 (37 MB at 32 slots) that cost 64 short simulated runs
# (2,047 passes each) 1.18-1.38 s of calls for 0.85-0.88 s of loops, the kernel zeroing fresh
# pages each time; at 1 << 13, 0.98-1.06 s, and a 243,428-pass replay's loop 4.64 s against
# 4.71 (2026-12-07).
BUFFER = 1 << 13
Backend = Simulator | RunnerStep


def first_carry(state: SchedState, carry: tuple, max_passes: int):
    """The loop's first carry: state, backend carry, passes run, clock, done, empty record."""
    b = state.num_slots
    grid = jnp.full((max_passes, b), -1, jnp.int32)
    zeros = jnp.zeros(max_passes, jnp.float32)
    count = jnp.zeros(max_passes, jnp.int32)
    rec = {k: grid for k in SLOT_FIELDS} | {k: count for k in PASS_FIELDS}
    rec |= {"start": zeros, "duration": zeros, "start_lo": zeros}
    now = jnp.zeros(2, jnp.float32)  # the clock as hi + lo (`_add`)
    return state, carry, jnp.int32(0), now, jnp.bool_(False), rec, jnp.float32(_INF)


def _add(now: jax.Array, x: jax.Array) -> jax.Array:
    """The clock [hi, lo] plus x, to float32's step squared: Knuth's two-sum keeps what hi + x
    rounds off in lo, so a clock of many passes drifts from the host loop's float64 by nothing a
    scheduling decision can see."""
    hi = now[0] + x
    back = hi - now[0]
    err = (now[0] - (hi - back)) + (x - back)
    lo = now[1] + err
    top = hi + lo  # renormalise: hi the nearest float32, lo the rest
    return jnp.stack([top, lo - (top - hi)])


def _seen(now: jax.Array) -> jax.Array:
    """The clock as the scheduler sees it: hi rounded down, so no arrival is admitted early."""
    return jnp.where(now[1] < 0, jnp.nextafter(now[0], jnp.float32(-_INF)), now[0])


def advance(policy: Policy, params: PolicyParams, backend: Backend, consts, max_passes: int,
            warm, window, carry):  # fmt: skip
    """One iteration: schedule at the clock; an idle plan moves the clock, any other runs a pass.
    Returns the next carry (its record untouched), the pass's record row and whether it ran (an
    idle plan, or a halted run, records nothing): `_step` writes the row at the run's pass count,
    a sweep at its iteration (`sweep_loop.sweep_segment`). An ended run stays as it is, so members
    of a sweep can step on together until the last ends: its clock stays, and its state is a fixed
    point of schedule and commit (nothing is queued, held or yet to arrive: tested for every
    policy), so no select between whole states is needed. A run at max_passes must not be stepped
    (both loops' conditions). `warm` (warm-up): pass p runs the backend's branch p, whatever the
    plan. With a `window` (run_device's exact clock), an idle plan whose wake lies beyond it does
    not jump there, where float32 is coarse: it leaves the wake in the carry's last field for the
    host, which moves the clock's origin near it."""
    st0, bc, p, now0, done0, rec, _ = carry
    warm = jnp.asarray(warm, bool)
    halted = done0 | (p >= max_passes)
    st, plan = policy.schedule(st0.replace(now=_seen(now0)), params)
    idle = (plan.kind == IDLE) & ~warm
    bc, tokens, cost, (rows, row_tokens, context) = backend.device_step(
        consts, bc, plan, idle | halted, jnp.where(warm, p, -1)
    )
    holder, kv = st.slot_req, kv_live(st, plan)
    # An idle plan feeds nothing, so its commit changes nothing: no select between whole states.
    st = policy.commit(st, plan, tokens, params)
    granted = kv_reserved(st)
    row = pass_row(now0[0], cost, plan, holder, (rows, row_tokens, context), kv, granted)
    row["start_lo"] = now0[1]  # the clock's low part (`_add`)
    ran = ~idle & ~halted
    far = idle & jnp.isfinite(plan.wait_until) & (plan.wait_until > (window or _INF))
    later = ~far & jnp.isfinite(plan.wait_until) & (plan.wait_until > _seen(now0))  # exactly
    wake = jnp.where(later, jnp.stack([plan.wait_until, jnp.float32(0)]), now0)
    now = jnp.where(idle | halted, jnp.where(halted, now0, wake), _add(now0, cost))
    done = done0 | (idle & ~halted & ~jnp.isfinite(plan.wait_until))
    far = jnp.where(far & ~halted, plan.wait_until, _INF).astype(jnp.float32)
    return (st, bc, p + ran.astype(jnp.int32), now, done, rec, far), row, ran


def _step(policy: Policy, params: PolicyParams, backend: Backend, consts, max_passes: int, warm,
          window, carry):  # fmt: skip
    """One iteration of a run (`advance`), its pass recorded at the run's pass count."""
    carry, row, ran = advance(policy, params, backend, consts, max_passes, warm, window, carry)
    at = jnp.where(ran, carry[2] - 1, max_passes)
    rec = {k: carry[5][k].at[at].set(v, mode="drop") for k, v in row.items()}
    return (*carry[:5], rec, carry[6])


def is_live(max_passes: int, carry):
    _, _, p, _, done, _, _ = carry
    return ~done & (p < max_passes)


def device_loop(
    policy: Policy, params: PolicyParams, state: SchedState, backend: Simulator, max_passes: int
):
    """A simulated run as a pure function of (params, state): returns the final state, the
    passes run and the record's arrays (max_passes of them: for long runs, `run_device`
    keeps a bounded buffer). Jittable; for many runs at once see `sweep_loop.run_sweep`."""
    step = partial(_step, policy, params, backend, backend.consts(), max_passes, False, None)
    st, _, p, _, _, rec, _ = jax.lax.while_loop(
        partial(is_live, max_passes), step, first_carry(state, (), max_passes)
    )
    return st, p, rec


def run_device(
    policy: Policy,
    params: PolicyParams,
    state: SchedState,
    backend: Backend,
    max_passes: int,
    clock: str = "passes",
    progress: bool = False,
    stop: Callable[[], bool] = never,
    arrival: np.ndarray | None = None,
) -> RunResult:
    """A run through the device loop, in segments (`stop()` is read between them). Compilation
    and one run of each of the backend's branches (XLA's first run of a branch costs far more than
    later ones) count as warm-up. The device holds the record of at most BUFFER passes: the host
    drains it whenever it fills, so memory follows the passes run, not `max_passes`. With
    `clock=measured` pass p starts at p x the loop's mean pass time; otherwise at the loop's
    clock (passes, or priced seconds). Priced seconds are exact as the host loop's: the device's
    float32 times are relative to an origin (`clock.Clock`, from `arrival`'s float64 times) that
    the host moves to the clock after every segment; a segment ends once its clock leaves
    clock.WINDOW, or at an idle wake beyond it, which the host nears in one step (`lookahead`)."""
    size = min(max_passes, BUFFER)
    consts = backend.consts()
    window = WINDOW if clock == "priced" else None
    times = Clock(np.asarray(state.arrival) if arrival is None else arrival)
    if window:
        state = times.rebase(state, 0.0)

    def segment(params, consts, carry, end, warm):
        step = partial(_step, policy, params, backend, consts, size, warm, window)

        def live(c):
            inside = (c[3][0] < window) & ~jnp.isfinite(c[6]) if window else True
            return jnp.where(warm, c[2] < end, is_live(size, c) & (c[2] < end) & inside)

        return jax.lax.while_loop(live, step, carry)

    def rebase(carry):  # the origin moves to the clock, or near a far wake (the host loop's rule)
        hi, lo = (float(x) for x in np.asarray(carry[3]))
        now, far = times.host(hi) + lo, float(carry[6])
        st = times.rebase(carry[0], times.lookahead(np.float32(far)) if np.isfinite(far) else now)
        rel = now - times.origin  # exact as hi + lo
        clock = jnp.array([np.float32(rel), np.float32(rel - np.float32(rel))], jnp.float32)
        return (st, *carry[1:3], clock, *carry[4:6], jnp.float32(_INF))

    compiles0, hits0, t0 = num_compiles(), cache_hits(), time.perf_counter()
    carry = _start_jit(state, backend.carry(), max_passes=size)
    # The carry keeps its placement across segments (on a mesh, the cache's sharding); XLA
    # would otherwise choose the outputs' and the next segment's inputs would not match.
    placed = jax.tree.map(lambda x: x.sharding, carry)
    args = (params, consts, carry, jnp.int32(0), False)
    key = backend.program_key and (policy, backend.program_key, size, window, _avals(args))
    run = _programs.get(key) if key else None
    if run is None:
        jitted = jax.jit(segment, donate_argnums=2, out_shardings=placed)
        named = key and built_in(policy)
        if named:  # found on disk by what makes it, without tracing it (`executables`)
            static = ("device_loop.segment", named, backend.program_key, size, window)
            run = compiled(jitted, static, args, keep=False, options=backend.compile_options)
        else:
            run = compile_now(jitted, args, backend.compile_options)
        if key:  # kept for the process, PROGRAMS_KEPT at most
            _programs[key] = run
            while len(_programs) > PROGRAMS_KEPT:
                del _programs[next(iter(_programs))]
    if backend.num_branches:
        # Warm-up runs branch p at pass p on a copy of the run's start (the token buffer too).
        # The K/V it leaves in the cache sit at stale positions, which no pass reads (each reads
        # only what its slot's request has written); the run then starts from `state`.
        scratch = jax.tree.map(jnp.copy, (state, carry[1][1:]))
        warm = (scratch[0], (carry[1][0], *scratch[1]), *carry[2:])
        warm = run(params, consts, warm, jnp.int32(backend.num_branches), True)
        carry = _start_jit(state, (warm[1][0], *carry[1][1:]), max_passes=size)
        jax.block_until_ready(carry)
    warmup_s, t0 = time.perf_counter() - t0, time.perf_counter()
    compiles_warm = num_compiles()
    live = np.asarray(state.status) != REJECTED
    bar = tqdm(total=int(np.asarray(state.max_new)[live].sum()), disable=not progress,
               unit="tok", desc=policy.name, leave=False)  # fmt: skip
    drained: list[dict] = []  # host copies of full buffers
    p, total, length = 0, 0, 8  # p: passes in the buffer; total: passes before it
    origins = []  # (passes, the origin their start times are relative to), segment by segment

    def drain(carry, p):
        drained.append({k: np.asarray(v[:p]) for k, v in jax.device_get(carry[5]).items()})
        return (*carry[:2], jnp.int32(0), *carry[3:])

    while not stop():
        t_segment = time.perf_counter()
        carry = run(params, consts, carry, jnp.int32(min(p + length, size)), False)
        p_next, done = int(carry[2]), bool(carry[4])  # waits for the segment
        if progress:
            bar.n = int(np.asarray(carry[0].num_generated).sum())
            bar.refresh()
        seconds = time.perf_counter() - t_segment
        length = int(np.clip(SEGMENT_S * (p_next - p + 1) / max(seconds, 1e-6), 8, 1 << 20))
        origins.append((p_next - p, times.origin))
        p = p_next
        if done or total + p >= max_passes:
            break
        if window:
            carry = rebase(carry)
        if p == size:
            carry, total, p = drain(carry, p), total + p, 0
    wall_s = time.perf_counter() - t0
    bar.close()
    carry = drain(carry, p)
    backend.keep(carry[1])
    final = jax.device_get(carry[0])
    p = total + p
    unfinished = bool(((final.status != FINISHED) & (final.status != REJECTED)).any())
    interrupted = unfinished and stop()
    if unfinished and not interrupted:
        raise RuntimeError(f"the device loop did not end within max_passes={max_passes}")
    cols = {k: np.concatenate([d[k] for d in drained]) for k in drained[0]}
    counts, offsets = [n for n, _ in origins], [o for _, o in origins]
    cols["start"] = cols["start"].astype(np.float64) + np.repeat(offsets, counts)
    unit = wall_s / max(p, 1) if clock == "measured" else None  # timed as a whole
    counts = (warmup_s, num_compiles() - compiles0, num_compiles() - compiles_warm,
              cache_hits() - hits0, wall_s)  # fmt: skip
    return run_result(cols, final, backend, unit, counts, interrupted)


_start_jit = jax.jit(first_carry, static_argnames="max_passes")
# A run's compiled segment, kept for the next run of the same program (the policy, the
# backend's `program_key`, the buffer, the clock's window and the inputs' shapes, dtypes and
# placements: a run's state and params, and the runner's weights and cache, are its inputs), so
# runs one after another in a process (a basic multirun, a notebook, calibration) compile once;
# the oldest beyond PROGRAMS_KEPT go. With the compile cache on, a program of `make_policy`'s
# policy is also saved whole (`executables`): a new process loads it without tracing (for the
# runner's realistic continuous run, a warm-up of 1.9 s against 4.7 s from JAX's cache alone).
_programs: dict = {}
PROGRAMS_KEPT = 8


def _avals(tree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(
        (np.shape(x), x.dtype if hasattr(x, "dtype") else np.result_type(x),
         getattr(x, "sharding", None))
        for x in leaves
    )  # fmt: skip


def clear_programs() -> None:
    """Forget the kept segments (tests drop their compiled programs module by module)."""
    _programs.clear()


def run_result(cols: dict, final: SchedState, backend: Backend, unit, counts, interrupted=False):
    """A RunResult from the loop's record columns (host arrays, one row per pass) and final state.
    `unit`: seconds per pass for a loop timed as a whole (else the loop's own clock); `counts`:
    warm-up seconds, compilations, those after warm-up, cache hits, wall seconds."""
    p = len(cols["kind"])
    cols = dict(cols)
    cols["start"] = cols["start"].astype(np.float64) + cols.pop("start_lo")  # the clock's hi + lo
    if unit is not None:
        cols["start"], cols["duration"] = np.arange(p) * unit, np.full(p, unit)
    record = from_columns(cols, np.asarray(final.prompt_len), final.num_slots)
    warmup_s, compiles, compiles_after, hits, wall_s = counts
    end = float(record.start[-1] + record.duration[-1]) if p else 0.0
    return RunResult(
        record=record, final=final, outputs=backend.outputs(np.asarray(final.num_generated)),
        logits=None, duration_s=end, warmup_s=warmup_s, num_compiles=compiles,
        compiles_after_warmup=compiles_after, cache_hits=hits, wall_s=wall_s,
        interrupted=interrupted, warmup_shapes=backend.num_branches,
    )  # fmt: skip
