"""Sweeps as one program: simulated runs of one policy and backend program (their workloads,
traced policy params and backend consts differ) stepped together as the device loop's iteration
(`device_loop.advance`) vmapped over the members, in groups on host threads, narrowed as members
end; each member's result equals its run alone (`device_loop.run_device`), field for field.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch import device_loop
from jaxbatch.backend.compilation import cache_hits, num_compiles
from jaxbatch.backend.simulator import Simulator
from jaxbatch.device_loop import PROGRAMS_KEPT, advance, first_carry, is_live, run_result
from jaxbatch.engine import RunResult
from jaxbatch.report.recorder import PASS_FIELDS, SLOT_FIELDS
from jaxbatch.sched.policies import Policy, PolicyParams
from jaxbatch.sched.state import FINISHED, REJECTED, SchedState


def sweep_segment(policy: Policy, backend: Simulator, max_passes: int, params: PolicyParams,
                  consts, carry, rec: dict, start, floor, steps):  # fmt: skip
    """One segment of a sweep: every member (carries, params and backend consts stacked on a
    leading axis) steps, vmapped, until each has ended, or until no more than `floor` are still
    stepping, or for `steps` iterations at most, or until the record is full. The record
    (`_sweep_record`) is flat, a row per member and iteration: iteration i writes the W members'
    rows at `start` + i x W, one contiguous update (rows at each member's own pass count would
    be a scatter), its `ran` marking the members whose iteration was a pass. So one record
    serves every width a sweep narrows to, and the host drains it only when it is full or the
    sweep has ended (`_step_lanes`). Returns the iterations run, the carry and the record. An
    ended member stays as it is (`advance`); once a member reaches max_passes the segment
    ends, and the host refuses the sweep."""
    step = jax.vmap(lambda pp, k, c: advance(policy, pp, backend, k, max_passes, False, None, c))
    width = carry[2].shape[0]
    room = (rec["slots"].shape[0] - start) // width  # iterations the record still holds

    def live(loop):
        i, c, _ = loop
        stepping = jax.vmap(partial(is_live, max_passes))(c)
        full = (c[2] >= max_passes).any()  # the host then stops: a run that did not end
        return (i < jnp.minimum(steps, room)) & stepping.any() & (stepping.sum() > floor) & ~full

    def body(loop):
        i, c, rec = loop
        c, row, ran = step(params, consts, c)
        row = row | {"ran": ran}
        packed = {part: jnp.stack([row[k].astype(rec[part].dtype) for k in fields], axis=1)
                  for part, fields in _SWEEP_PARTS.items()}  # fmt: skip
        at = start + i * width
        rec = {k: jax.lax.dynamic_update_slice_in_dim(rec[k], packed[k], at, 0) for k in rec}
        return i + 1, c, rec

    return jax.lax.while_loop(live, body, (jnp.int32(0), carry, rec))


# A sweep's record, packed in three arrays (one update each per iteration): the per-slot fields,
# the per-pass counts (with `ran`: the iteration was a pass) and the times.
_SWEEP_PARTS = {
    "slots": SLOT_FIELDS,
    "counts": tuple(k for k in PASS_FIELDS if k not in ("start", "duration")) + ("ran",),
    "times": ("start", "duration", "start_lo"),
}


def _sweep_record(rows: int, num_slots: int) -> dict:
    """A sweep's record buffer (`_SWEEP_PARTS`): `rows` rows, a member's iteration each."""
    slots = jnp.zeros((rows, len(SLOT_FIELDS), num_slots), jnp.int32)
    counts = jnp.zeros((rows, len(_SWEEP_PARTS["counts"])), jnp.int32)
    return {"slots": slots, "counts": counts, "times": jnp.zeros((rows, 3), jnp.float32)}


def _unpack(rows: dict, width: int, lane: int) -> dict:
    """A member's passes (the rows its iterations ran) from a segment's rows of a drained sweep
    record (iterations x `width` lanes), by field."""
    at = slice(lane, None, width)
    ran = rows["counts"][at, -1] > 0
    return {k: rows[part][at, j][ran] for part, fields in _SWEEP_PARTS.items()
            for j, k in enumerate(fields) if k != "ran"}  # fmt: skip


SWEEP_BYTES = 1 << 28  # record a sweep keeps on the device between drains, all groups together
MIN_LANES = 8  # a sweep narrows to no fewer members than this


def _widths(m: int) -> list[int]:
    """The widths a sweep of m members steps at: m, then the powers of two from m / 2 down to
    MIN_LANES, each taken once no more than it are still running."""
    widths, w = [m], 1 << max(m - 1, 0).bit_length()
    while w // 2 >= MIN_LANES:
        w //= 2
        if w <= m // 2:
            widths.append(w)
    return widths


def _narrow(lanes: np.ndarray, done: np.ndarray, floor: int):
    """The lanes a sweep keeps once no more than `floor` (the next width) of its members are
    still running: those members' lanes, then copies of an ended lane (which stays halted) up to
    `floor`; None while more are running. A sweep narrows one width at a time (a segment at the
    next width that has nothing to do ends at once), so each width needs one gather."""
    running = np.flatnonzero(~done & (lanes >= 0))
    if not floor or len(running) > floor:
        return None
    spare = int(np.flatnonzero(done)[0])
    return np.concatenate([running, np.full(floor - len(running), spare)]).astype(np.int32)


def sweep_groups(m: int) -> int:
    """How many groups `run_sweep` splits m members into, each stepped by its own host thread.
    On the CPU one per core (no group under MIN_LANES members): XLA:CPU runs a vmapped step's
    small operations one after another on about one core, so a second group on a second thread
    runs beside it (two 32-member halves of a loop took 7.1-8.0 ms in two threads against
    12.8-13.1 ms one after the other, 2 cores). On an accelerator one: its kernels already use it
    whole."""
    if jax.default_backend() != "cpu":
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, m // MIN_LANES))


def run_sweep(
    policy: Policy, params: list[PolicyParams], states: list[SchedState],
    backends: list[Simulator], max_passes: int, groups: int | None = None,
) -> list[RunResult]:  # fmt: skip
    """Simulated runs of one program (the same policy, shapes and static backend; their workloads,
    traced params and backend consts differ) as one compiled, vmapped device loop; returns each
    member's result, as `run_device` would (tested field for field). Members keep a plain
    float32 clock (a microsecond up to 8 s). The members are split into `groups` (default
    `sweep_groups`; by `_split`), each a vmapped loop stepped by its own host thread. Member i
    in group i % groups gives each group its share of the long ones, so that the threads end
    together: over arrival rates 4.3x and 5.2x against 3.2x and 4.0x for contiguous groups
    (medians of 5, interleaved, 2026-12-06); over seeds within the spread; `_split` improves on
    it where the members' last arrivals differ. A group's members step together, so it costs its
    longest member's passes times its width: once no more than half of them are still running,
    the host narrows it to them (`_widths`; an ended member's state is kept), so a sweep of
    members of very different lengths does not step its ended ones to the end. Compilation (one
    program per width, all before the clock starts) counts as every member's warm-up, the loop's
    wall time as every member's. Each group keeps a flat record on the device (SWEEP_BYTES for
    all groups, allocated before the clock starts as `run_device`'s buffer is), a row per member
    and iteration at every width (`sweep_segment`); the host drains it when it is full, and once
    the loop has ended, as `run_device` drains its buffer. Drained at every narrowing and every
    64 MB, the records cost the rate sweep of `benchmarks/sim_speed.py` a third of its loop's
    time (the host's copies of them fill fresh memory, 0.5-2 ms a MB on this VM): 0.219 against
    0.323 s, seeds 0.130 against 0.153 s (medians of 7 interleaved rounds, 2026-12-06). An
    ended member steps on unselected (a fixed point, `advance`)."""
    m, b = len(states), states[0].num_slots
    row_bytes = 4 * (len(SLOT_FIELDS) * b + len(_SWEEP_PARTS["counts"]) + 3)  # a member's row
    stack = lambda xs: jax.tree.map(lambda *x: np.stack(x), *xs)  # noqa: E731
    g = max(1, min(groups or sweep_groups(m), m))
    split = _split([float(np.max(np.asarray(st.arrival), initial=0.0)) for st in states], g)
    wide = len(split[0])  # the widest group: a record holds at least 16 of its iterations
    rows = int(np.clip(SWEEP_BYTES // (g * row_bytes), 16 * wide, max_passes * wide))
    backend = backends[0]
    compiles0, hits0, t0 = num_compiles(), cache_hits(), time.perf_counter()
    start, record = _sweep_start, _sweep_record_jit
    trees = [
        (stack([params[i] for i in idx]), stack([backends[i].consts() for i in idx]),
         start(stack([states[i] for i in idx])), record(rows, b))
        for idx in split
    ]  # fmt: skip
    segment = jax.jit(partial(sweep_segment, policy, backend, max_passes), donate_argnums=(2, 3))
    take = jax.jit(_take)
    # Kept for the next sweep of the same program in the process, as `run_device`'s segments.
    leaves, tree = jax.tree.flatten(trees[0][:3])
    key = (policy, backend.program_key, max_passes, rows, tree,
           tuple((x.shape[1:], x.dtype, getattr(x, "sharding", None)) for x in leaves))  # fmt: skip
    programs, gathers = _programs.setdefault(key, ({}, {}))
    while len(_programs) > PROGRAMS_KEPT:
        del _programs[next(iter(_programs))]
    # each width once (groups of one size share their programs; a width compiled by an earlier
    # sweep is neither compiled nor run again); the warm-up writes the record's first rows,
    # which the run writes again before anything reads them
    trees = [(*tree[:3], _compile_widths(segment, take, tree, programs, gathers))
             for tree in trees]  # fmt: skip
    warmup_s, compiles_warm, t0 = time.perf_counter() - t0, num_compiles(), time.perf_counter()
    lanes = partial(_step_lanes, programs, gathers, max_passes)
    with ThreadPoolExecutor(len(trees)) as pool:
        done = list(pool.map(lanes, trees))
    wall_s = time.perf_counter() - t0
    counts = (warmup_s, num_compiles() - compiles0, num_compiles() - compiles_warm,
              cache_hits() - hits0, wall_s)  # fmt: skip
    results = [None] * m
    for idx, (drained, (rec, segments), finals) in zip(split, done):
        _drain(jax.device_get(rec), segments, drained)  # the record the group ended with
        for i, member, final in zip(idx, drained, finals):
            if ((final.status != FINISHED) & (final.status != REJECTED)).any():
                raise RuntimeError(f"sweep member {i} did not end within "
                                   f"max_passes={max_passes}")  # fmt: skip
            cols = {k: np.concatenate([d[k] for d in member]) for k in member[0]}
            results[i] = run_result(cols, final, backend, None, counts)
    return results


def _split(last_arrival: list[float], g: int) -> list[np.ndarray]:
    """The members of each of g groups (ids in order). Member i in group i % g: a sweep's
    members in order tend to differ in length smoothly, so each group gets its share of the long
    ones. But where the members' last arrivals differ (a sweep over arrival rates or workloads),
    the MIN_LANES members whose last request arrives latest, which run at least that long, share
    group 0 with those whose last arrives earliest, and the others fill the other groups in turn:
    group 0 soon narrows to MIN_LANES lanes and steps its long members there, while the middle
    ones step together elsewhere. Over `sim_speed.py`'s arrival rates, 0.934 and 0.962 of the
    time (medians of 11 and 15 interleaved rounds), over its seeds 0.986 (2026-12-07); a step
    model with the members' real lengths had put it at 136 ms against 149 for the two threads."""
    m = len(last_arrival)
    interleaved = [np.arange(k, m, g) for k in range(g)]
    if g == 1 or len(set(last_arrival)) == 1:
        return interleaved
    size, latest = len(interleaved[0]), np.argsort(-np.asarray(last_arrival), kind="stable")
    k = min(MIN_LANES, size)
    first = np.sort(np.concatenate([latest[:k], latest[m - (size - k) :]]))
    rest = np.setdiff1d(np.arange(m), first)
    return [first, *(rest[j :: g - 1] for j in range(g - 1))]


_sweep_start = jax.jit(jax.vmap(partial(first_carry, carry=(), max_passes=0)))
_sweep_record_jit = jax.jit(_sweep_record, static_argnums=(0, 1))


def _take(tree, idx):
    """A group's params, consts and carry narrowed to the lanes `idx` (the record is flat, a row
    per member and iteration, so it serves every width as it is)."""
    return jax.tree.map(lambda x: x[idx], tree)


def _at_width(tree, w: int):
    """The shapes of `tree` (params, consts and carry, each leading with the members) at width w."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((w, *x.shape[1:]), x.dtype), tree)


def _compile_widths(segment, take, tree, programs: dict, gathers: dict) -> dict:
    """Every width's program a group of `tree`'s width steps at, and the gather that narrows
    it to the next, compiled (those not in `programs` and `gathers` yet) and run once each on a
    copy of the group's start (XLA's first run of a program costs far more than later ones),
    writing the record's first rows. Returns the record, which the runs donate."""
    widths = _widths(len(tree[2][2]))
    steps = list(zip(widths, widths[1:] + [0]))
    if all(w in programs and (not to or (w, to) in gathers) for w, to in steps):
        return tree[3]  # every program compiled and run once by an earlier sweep
    group, rec = jax.jit(lambda t: jax.tree.map(jnp.copy, t))(tree[:3]), tree[3]
    zero = jnp.int32(0)
    for w, to in steps:
        if w not in programs:
            programs[w] = segment.lower(*_at_width(group, w), rec, zero, zero, zero).compile()
            _, carry, rec = programs[w](*group, rec, zero, zero, jnp.int32(1))
            group = (*group[:2], carry)
        if to:
            if (w, to) not in gathers:
                idx = np.zeros(to, np.int32)
                gathers[w, to] = take.lower(_at_width(group, w), idx).compile()
            group = gathers[w, to](group, np.arange(to, dtype=np.int32))
    jax.block_until_ready((group, rec))
    return rec


def _drain(rows: dict, segments: list, drained: list[list[dict]]) -> None:
    """Each member's passes from a sweep record's rows (host arrays), segment by segment (the
    lanes' members, width, first row, iterations), appended to `drained` by member."""
    for lanes, width, first, n in segments:
        part = {k: v[first : first + n * width] for k, v in rows.items()}
        for lane, member in enumerate(lanes):
            if member >= 0:
                drained[member].append(_unpack(part, width, lane))


def _step_lanes(programs: dict, gathers: dict, max_passes: int, tree):
    """One group stepped to its end (a host thread's work in `run_sweep`): segments of its
    width's program, narrowed once no more than the next width's members are running, each
    segment writing on in the record where the last stopped. The host drains the record only
    when it is full (as `run_device` drains its buffer); `run_sweep` drains the last one once
    every group has ended. Returns each member's drained passes, the record on the device with
    its segments (the lanes' members, width, first row, iterations), and the final states."""
    pstack, consts, carry, rec = tree
    m = len(carry[2])
    rows = rec["slots"].shape[0]
    drained: list[list[dict]] = [[] for _ in range(m)]
    segments: list[tuple[np.ndarray, int, int, int]] = []  # those in the record since a drain
    at = 0  # the rows the record holds
    finals: list[SchedState | None] = [None] * m
    lanes = np.arange(m)  # each lane's member; -1: a spare lane (a copy of an ended one)

    def keep_finals(final, which):  # the final states of the lanes `which`, by member
        for lane in which:
            finals[lanes[lane]] = jax.tree.map(lambda x, i=lane: x[i], final)

    while True:
        width = len(lanes)
        widths = [w for w in _widths(m) if w < width]
        floor = widths[0] if widths else 0
        i, carry, rec = programs[width](pstack, consts, carry, rec, jnp.int32(at),
                                        jnp.int32(floor), jnp.int32(2**31 - 1))  # fmt: skip
        i, passes, done = jax.device_get((i, carry[2], carry[4]))
        segments.append((lanes, width, at, int(i)))
        at += int(i) * width
        ours = lanes >= 0
        if done[ours].all() or (passes[ours] >= max_passes).any():
            break
        if at + width > rows:  # full: drained, and written again from its first row
            _drain(jax.device_get(rec), segments, drained)
            segments, at = [], 0
        idx = _narrow(lanes, done, floor)
        if idx is not None:
            keep_finals(jax.device_get(carry[0]), np.flatnonzero(done & ours))
            pstack, consts, carry = gathers[width, floor]((pstack, consts, carry), idx)
            lanes = np.where(np.arange(len(idx)) < (~done & ours).sum(), lanes[idx], -1)
    keep_finals(jax.device_get(carry[0]), np.flatnonzero(lanes >= 0))
    return drained, (rec, segments), finals


_programs: dict = {}  # each sweep program's widths and narrowings, kept as `device_loop`'s


def clear_programs() -> None:
    """Forget the kept programs, the sweeps' and the device loop's (tests drop theirs module by
    module)."""
    _programs.clear()
    device_loop.clear_programs()
