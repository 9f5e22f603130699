"""The loop: schedule -> execute -> commit, on the host, one iteration per forward pass.

Each iteration runs the pass, then commit and the next schedule fused in one jitted call, with one
host sync. The clock is wall time measured from the loop's start (or one unit per pass with the
`passes` clock, or the cost model's price of each pass with the `priced` one); when nothing can
run it jumps to the policy's wake time, so runs never sleep.
Warm-up compiles everything before the clock starts: every shape the workload can use, or, where
no plan depends on wall time or on the tokens (no EOS; an offline run, or the `passes` clock),
only the shapes a dry run of the loop on a backend that runs nothing meets (`planned_shapes`).
No metrics or I/O here.

The host needs the next plan to pick the next pass's compiled shape, so the device would idle
while the plan travels to the host. After a prefill or decode pass in which no request reaches its
output budget, and with every request arrived, the next pass is almost surely the decode of every
held slot, one position on: the loop dispatches it on the device's copy of the next plan before
syncing. The pass checks on the device that the plan is a decode pass fitting its shape, and feeds
nothing if not; the host makes the same check (`decode_fits`) once the plan arrives and then runs
the right pass. Plans never depend on the guess, so neither do tokens.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from tqdm.auto import tqdm

from jaxbatch.backend.buckets import Buckets, PassShape, decode_fits
from jaxbatch.backend.compilation import cache_hits, num_compiles
from jaxbatch.backend.executables import remembered
from jaxbatch.backend.simulator import Simulator
from jaxbatch.clock import Clock
from jaxbatch.interrupt import never
from jaxbatch.report.recorder import Record, Recorder
from jaxbatch.resume import Carry, Checkpoints, restore
from jaxbatch.sched.policies import Policy, PolicyParams, built_in
from jaxbatch.sched.state import DECODE, FINISHED, IDLE, PREFILL, REJECTED, Plan, SchedState


class Backend(Protocol):
    buckets: object
    # Whether the loop dispatches the next decode before the host has seen its plan (`ahead`):
    # the runner's pass then runs while the host commits, at the shape the host guessed, which
    # the record keeps. The simulator runs nothing, so its passes run (and are priced and
    # recorded) at their own plans' shapes, as in its device loop.
    runs_ahead: bool

    def warmup(self, shapes: list[PassShape], stop: Callable[[], bool] = never) -> None: ...
    def execute(
        self, plan: Plan, shape: PassShape, on_device: Plan | None = None
    ) -> tuple[Array, Array | None]: ...
    def decode(self, plan: Plan, shape: PassShape) -> tuple[Array, Array | None]: ...
    def outputs(self, num_generated: np.ndarray) -> list[np.ndarray] | None: ...
    def carry(self) -> tuple: ...  # its device buffers, which a checkpoint saves
    def keep(self, carry: tuple) -> None: ...


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
    cache_hits: int  # compiled shapes loaded from the persistent compilation cache instead
    wall_s: float  # host wall time of the loop
    interrupted: bool = False  # stopped early (Ctrl-C): the record holds the passes done
    warmup_shapes: int = 0  # pass shapes the warm-up compiled or loaded, and ran once
    warmup_planned: bool = False  # those were the shapes a dry run met (`planned_shapes`)

    def request_logits(self) -> dict[int, np.ndarray]:
        """Per request, the logits [outputs, V] that produced its output tokens, in order."""
        rec, out = self.record, {}
        for p, b in zip(*np.nonzero(rec.emits)):
            out.setdefault(int(rec.req[p, b]), []).append(self.logits[p][b])
        return {i: np.stack(v) for i, v in sorted(out.items())}


def kv_live(state: SchedState, plan: Plan) -> Array:
    """KV positions holding the cached tokens of the held requests once `plan`'s pass is
    committed, from the state it was planned from: a fed slot's tokens up to its start_pos +
    num_tokens (as `commit` sets them), another's as cached. Reading the state before the commit
    shares `commit`'s gather of num_computed (XLA computes equal gathers once)."""
    cached = state.num_computed[jnp.maximum(state.slot_req, 0)]
    after = jnp.where(plan.num_tokens > 0, plan.start_pos + plan.num_tokens, cached)
    return jnp.where(state.slot_req >= 0, after, 0).sum()


def kv_reserved(state: SchedState) -> Array:
    """KV positions granted to held requests: blocks in use (paged) or reservations."""
    mem = state.memory
    if mem is None:
        return jnp.int32(0)
    if mem.paged:
        return (state.block_table >= 0).sum() * mem.block_size
    return state.reserved.sum()


def pack(plan: Plan, holder: Array, kv: Array, reserved: Array) -> Array:
    """The next plan and this pass's stats as one int32 vector: one device-to-host copy."""
    scalars = jnp.stack(
        [plan.kind, kv.astype(jnp.int32), reserved.astype(jnp.int32),
         jax.lax.bitcast_convert_type(plan.wait_until, jnp.int32)]
    )  # fmt: skip
    rows = [plan.req, plan.num_tokens, plan.start_pos, holder, plan.block_table.ravel()]
    return jnp.concatenate([scalars] + [r.astype(jnp.int32) for r in rows])


def next_ends(
    plan: Plan, ends: np.ndarray, prompt_len: np.ndarray, max_new: np.ndarray
) -> tuple[np.ndarray, bool]:
    """Track, from the host-side plans seen, where each slot's next token goes (0: it will feed
    no more), and say whether the next pass can be guessed: after a prefill or decode pass in which
    no request reaches its output budget (an EOS may still end one), it is the decode of every
    slot with a next token. A decode pass feeds every running slot; a prefill pass only new or
    resumed ones."""
    fed = plan.num_tokens > 0
    r = np.maximum(plan.req, 0)
    end = plan.start_pos + plan.num_tokens
    done = fed & (end - prompt_len[r] + 1 >= max_new[r])  # outputs once this pass emits
    kind = int(plan.kind)
    ends = np.where(fed, end, 0 if kind == DECODE else ends)
    return np.where(done, 0, ends), kind in (PREFILL, DECODE) and not done.any()


def ahead_shape(buckets: Buckets, ends: np.ndarray) -> PassShape:
    """The decode dispatched ahead of its plan (`next_ends`): every slot with a next token, the
    furthest at position ends.max()."""
    return buckets.decode(int(ends.max()) + 1, int((ends > 0).sum()))


def unpack(vec: np.ndarray, num_slots: int) -> tuple[Plan, np.ndarray, int, int]:
    """Inverse of pack, on the host: (plan, holder, kv, reserved) as numpy."""
    b = num_slots
    req, num_tokens, start_pos, holder = (vec[4 + i * b : 4 + (i + 1) * b] for i in range(4))
    plan = Plan(
        req=req, num_tokens=num_tokens, start_pos=start_pos, kind=vec[0],
        wait_until=vec[3:4].view(np.float32)[0], block_table=vec[4 + 4 * b :].reshape(b, -1),
    )  # fmt: skip
    return plan, holder, int(vec[1]), int(vec[2])


# The longest dry run that picks a run's warm-up shapes (`planned_shapes`): about 0.3 ms a pass.
PLANNED_PASSES = 5_000


class ShapeLog(Simulator):
    """The simulator on `buckets` (it runs nothing and draws token 0), counting the passes of each
    shape the loop asks it for (those dispatched ahead included), in order of first use."""

    runs_ahead = True  # as the runner, whose warm-up these shapes are

    def __init__(self, buckets: Buckets):
        super().__init__(buckets.num_slots, buckets.max_len)
        self.buckets, self.shapes = buckets, {}

    def execute(self, plan: Plan, shape: PassShape, on_device: Plan | None = None):
        return self.decode(plan, shape)

    def decode(self, plan: Plan, shape: PassShape):
        self.shapes[shape] = self.shapes.get(shape, 0) + 1
        return super().decode(plan, shape)


def fixed_plans(state: SchedState, params: PolicyParams, clock: str = "measured") -> bool:
    """Whether a run's plans are fixed before it starts, depending neither on wall time nor on
    the tokens drawn: no token ends a request (no EOS), and either the clock counts passes, or
    every request is there from the start and no policy waits on the clock for a fuller batch.
    A dry run on the `passes` clock then meets every plan the run will (`planned_shapes`)."""
    if int(params.eos_id) >= 0:
        return False
    arrived = bool((np.asarray(state.arrival) <= 0).all())
    return clock == "passes" or (arrived and float(params.max_wait_s) <= 0)


def planned_shapes(
    policy: Policy, params: PolicyParams, state: SchedState, buckets, max_passes: int,
    arrival: np.ndarray | None = None,
) -> dict[PassShape, int] | None:  # fmt: skip
    """The shapes of every pass a run of `state` will execute, where its plans are fixed
    (`fixed_plans`), each with its count of passes, in order of first use: the loop run once on
    a `ShapeLog`, on the `passes` clock; None if that would take more than `max_passes` passes
    (a long run needs most shapes anyway): at once where the outputs alone need more decodes of
    every slot."""
    if int(np.asarray(state.max_new).sum()) > max_passes * state.num_slots:
        return None
    log, calls = ShapeLog(buckets), itertools.count()
    stop = lambda: next(calls) >= max_passes  # noqa: E731
    dry = run(policy, params, state, log, [], "passes", arrival=arrival, stop=stop)
    done = np.isin(dry.final.status, (FINISHED, REJECTED)).all()
    return log.shapes if done else None


# A shape met by at most this share of a dry run's passes (at least one pass) runs one context
# bucket up where the run has that shape (`Buckets.raise_rare`).
RARE_SHARE = 0.01


def plan_warmup(
    policy: Policy, params: PolicyParams, state: SchedState, backend: Backend,
    arrival: np.ndarray | None = None,
) -> list[PassShape] | None:  # fmt: skip
    """The shapes a run whose plans are fixed warms up (None: a dry run would be too long, see
    `planned_shapes`): those its dry run meets, on the backend's buckets at every pass's own
    context bucket, with the rare ones raised (`Buckets.raise_rare`: the backend's buckets are
    replaced in place, before anything compiles), so each of the few passes of a rare shape
    runs at a shape the run compiles anyway. Realistic chunked (`benchmarks/warmup.py`) then
    prepares 9 shapes, not 12. A built-in policy's dry run is kept in the compile store
    (`executables.remembered`, keyed by the code and every input), so a repeated run of the
    same config reads its shapes: the dry run was 0.11-0.16 s of the host loop's repeated
    warm-ups on the realistic workload and 0.25-0.34 s of the device loop's (whose dry run also
    loads the host loop's scheduler programs)."""
    own = replace(backend.buckets, raised=())

    def dry_run():
        return planned_shapes(policy, params, state, own, PLANNED_PASSES, arrival)

    named = built_in(policy)  # a registered policy's code is in no key: planned every time
    static = ("engine.planned_shapes", named, own, PLANNED_PASSES)
    counts = dry_run() if named is None else remembered(static, (params, state, arrival), dry_run)
    if counts is None:
        return None
    backend.buckets = own.raise_rare(counts, max(1, int(RARE_SHARE * sum(counts.values()))))
    return list(dict.fromkeys(backend.buckets.runs_at(s) for s in counts))


@cache
def _stepper(policy: Policy):
    """commit the pass, then schedule the next one: one jitted call and one host sync per pass.

    Also returns each slot's holder during the committed pass and the KV positions in use after it.
    """

    def step(state, plan, tokens, params, now):
        holder, kv = state.slot_req, kv_live(state, plan)
        state = policy.commit(state, plan, tokens, params)
        reserved = kv_reserved(state)
        state, next_plan = policy.schedule(state.replace(now=now), params)
        return state, next_plan, pack(next_plan, holder, kv, reserved)

    return jax.jit(step)


def run(
    policy: Policy,
    params: PolicyParams,
    state: SchedState,
    backend: Backend,
    warmup_shapes: list[PassShape],
    clock: str = "measured",
    progress: bool = False,
    max_passes: int = 10_000_000,
    arrival: np.ndarray | None = None,
    stop: Callable[[], bool] = never,
    checkpoints: Checkpoints | None = None,
    resume_from: Path | None = None,
) -> RunResult:
    """Run every request to the end, or until `stop()` says to (checked between passes and
    between warm-up shapes). `arrival` holds the requests' exact (float64) arrival times, which
    `state.arrival` holds rounded to float32; the clock keeps them exact (`clock.Clock`).
    `checkpoints` saves the loop's carry every so many passes and where `stop()` ends it;
    `resume_from` continues from the latest checkpoint in that directory (resume.py)."""
    schedule, step = jax.jit(policy.schedule), _stepper(policy)
    times = Clock(np.asarray(state.arrival) if arrival is None else arrival)
    state = times.rebase(state, 0.0)
    compiles0, hits0, t0 = num_compiles(), cache_hits(), time.perf_counter()
    warm_state, warm_plan = schedule(state.replace(now=times.device(0.0)), params)  # as the run
    dummy = jnp.zeros_like(warm_plan.req)
    jax.block_until_ready(step(warm_state, warm_plan, dummy, params, np.float32(0)))
    planned = None
    if warmup_shapes and resume_from is None and fixed_plans(state, params, clock):
        planned = plan_warmup(policy, params, state, backend, arrival)
    warmup_shapes = warmup_shapes if planned is None else planned
    backend.warmup(warmup_shapes, stop)
    resumed = None  # restored within warm-up: orbax compiles its own copies
    if resume_from is not None:
        like = Carry(state, warm_plan, backend.carry(), {}, 0.0, 0.0, 0, np.zeros(0), False)
        resumed = restore(resume_from, like)
    warmup_s = time.perf_counter() - t0
    compiles_warm = num_compiles()

    recorder = Recorder(np.asarray(state.prompt_len))
    logits: list[np.ndarray] = []
    live = np.asarray(state.status) != REJECTED
    bar = tqdm(
        total=int(np.asarray(state.max_new)[live].sum()), disable=not progress, unit="tok",
        desc=policy.name, leave=False,
    )  # fmt: skip
    measured, priced = clock == "measured", clock == "priced"
    last_arrival = float(np.max(times.arrival, initial=0.0))
    waits = float(params.max_wait_s) > 0  # static's wait for a full batch reads the clock
    loop_start = time.perf_counter()
    skipped = 0.0  # clock time jumped over while idle: runs never sleep
    elapsed = lambda: time.perf_counter() - loop_start + skipped  # noqa: E731
    now, passes = 0.0, 0
    prompt_len, max_new = np.asarray(state.prompt_len), np.asarray(state.max_new)
    ends = np.zeros(state.num_slots, np.int64)  # see next_ends
    ahead = None  # (shape, tokens, logits) of a decode pass dispatched before its plan was seen

    def carry() -> Carry:
        return Carry(state, plan, backend.carry(), recorder.columns(), now, times.origin, passes,
                     ends, ahead is not None)  # fmt: skip

    if resumed:
        state, plan, now, passes = resumed.state, resumed.plan, resumed.now, resumed.passes
        times.origin, ends, skipped = resumed.origin, resumed.ends, resumed.now
        backend.keep(resumed.backend)
        recorder.resume(resumed.record)
        bar.update(int(np.asarray(state.num_generated).sum()))
        if resumed.ahead:  # as the interrupted run dispatched it (rewriting the same K/V)
            guess = ahead_shape(backend.buckets, ends)
            ahead = (guess, *backend.decode(plan, guess))
    else:
        state, plan = schedule(state.replace(now=times.device(now)), params)
    plan_h = jax.device_get(plan)
    while not stop():
        if int(plan_h.kind) == IDLE:
            ahead = None  # it fed nothing: its plan was no decode pass
            if not np.isfinite(plan_h.wait_until):
                break
            if not times.near(times.host(plan_h.wait_until)):  # coarse: look again from nearer
                state = times.rebase(state, times.lookahead(plan_h.wait_until))
                state, plan = schedule(state.replace(now=times.device(now)), params)
                plan_h = jax.device_get(plan)
                continue
            wake = max(now, times.host(plan_h.wait_until))
            if measured:
                skipped += max(0.0, wake - elapsed())
            now = wake
            state, plan = schedule(state.replace(now=times.device(now)), params)
            plan_h = jax.device_get(plan)
            continue
        if passes == max_passes:
            raise RuntimeError(f"the run did not end within max_passes={max_passes}")
        if ahead and decode_fits(plan_h, ahead[0]):
            shape, tokens, pass_logits = ahead  # it ran on this very plan
        else:  # nothing ran ahead, or what did fed nothing
            shape = backend.buckets.shape_of(plan_h)
            tokens, pass_logits = backend.execute(plan_h, shape, plan)
        ahead = None
        if measured and (now < last_arrival or waits):
            # The next schedule must see every arrival up to the pass's end. Once all requests
            # have arrived (and no policy waits on the clock) its `now` changes nothing, so the
            # commit is queued behind the pass without a sync; the pass's end is still measured.
            jax.block_until_ready(tokens)
        sched_at = elapsed() if measured else now + (backend.price(plan_h) if priced else 1.0)
        if not times.near(sched_at):
            state = times.rebase(state, sched_at)
        state, next_plan, stats = step(state, plan, tokens, params, times.device(sched_at))
        ends, guessable = next_ends(plan_h, ends, prompt_len, max_new)
        if guessable and now >= last_arrival and backend.runs_ahead:
            guess = ahead_shape(backend.buckets, ends)
            ahead = (guess, *backend.decode(next_plan, guess))
        next_h, holder, kv, reserved = unpack(np.asarray(stats), state.num_slots)
        # A measured pass ends once its commit and the next plan are ready.
        end = elapsed() if measured else sched_at
        if pass_logits is not None:
            logits.append(np.asarray(pass_logits))
        bar.update(recorder.add(now, end - now, plan_h, holder, shape, kv, reserved))
        now, plan, plan_h, passes = end, next_plan, next_h, passes + 1
        if checkpoints and checkpoints.due(passes):
            checkpoints.save(carry())
    if checkpoints and stop():
        checkpoints.save(carry())
    wall_s = time.perf_counter() - loop_start
    bar.close()
    final, interrupted = jax.device_get(state), stop()
    stuck = np.flatnonzero((final.status != FINISHED) & (final.status != REJECTED))
    if len(stuck) and not interrupted:  # a policy that leaves requests unserved is a bug
        raise RuntimeError(
            f"{policy.name}: the run ended with {len(stuck)} requests neither finished nor "
            f"rejected (ids {stuck[:10].tolist()}...): the policy can never schedule them"
        )
    return RunResult(
        record=recorder.finish(state.num_slots),
        final=final,
        outputs=backend.outputs(np.asarray(final.num_generated)),
        logits=None if resumed else logits or None,  # a resumed run has only the later passes
        duration_s=now,
        warmup_s=warmup_s,
        num_compiles=num_compiles() - compiles0,
        compiles_after_warmup=num_compiles() - compiles_warm,
        cache_hits=cache_hits() - hits0,
        wall_s=wall_s,
        interrupted=interrupted,
        warmup_shapes=len(warmup_shapes),
        warmup_planned=planned is not None,
    )
