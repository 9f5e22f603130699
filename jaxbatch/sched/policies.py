"""Batching policies as pure jax.numpy functions: schedule(state, params) and commit(...).

`static` holds a batch in its slots until its slowest request ends (request-level batching);
`continuous` frees a slot the moment its request ends and refills it before the next pass
(iteration-level batching, Orca). Both admit in a queue order (FCFS, shortest prompt first or
priority). Nothing here may touch the host.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct
from jax import Array

from jaxbatch.config import add_policy_name
from jaxbatch.inplace import batched, run_if, set_few
from jaxbatch.sched.blocks import allocate, blocks_for, free_slots
from jaxbatch.sched.state import (
    DECODE,
    FINISHED,
    IDLE,
    MIXED,
    PREEMPTED,
    PREFILL,
    QUEUE_ORDERS,
    RUNNING,
    WAITING,
    Plan,
    SchedState,
)

_INF = jnp.float32(jnp.inf)


@struct.dataclass
class PolicyParams:
    """Traced policy knobs: sweeping them does not recompile."""

    max_wait_s: Array = struct.field(default_factory=lambda: jnp.float32(0.0))
    eos_id: Array = struct.field(default_factory=lambda: jnp.int32(-1))  # -1: ignore EOS
    watermark_blocks: Array = struct.field(default_factory=lambda: jnp.int32(0))  # kept free
    # orca and chunked: tokens a pass may feed; chunked: a prompt chunk's cap (0: none) and the
    # most prompts fed in one pass (0: any number).
    token_budget: Array = struct.field(default_factory=lambda: jnp.int32(512))
    threshold: Array = struct.field(default_factory=lambda: jnp.int32(0))
    max_prefills: Array = struct.field(default_factory=lambda: jnp.int32(0))


class Policy(NamedTuple):
    name: str
    schedule: Callable[[SchedState, PolicyParams], tuple[SchedState, Plan]]
    commit: Callable[[SchedState, Plan, Array, PolicyParams], SchedState]


def _queued(state: SchedState) -> Array:
    """[N] requests that may be admitted now: waiting or preempted, and arrived."""
    return ((state.status == WAITING) | (state.status == PREEMPTED)) & (state.arrival <= state.now)


def next_arrival(state: SchedState) -> Array:
    """When the next request not yet arrived arrives (inf: none left): an idle plan's wake."""
    future = (state.status == WAITING) & (state.arrival > state.now)
    return jnp.min(jnp.where(future, state.arrival, _INF))


def release(state: SchedState, mask: Array) -> SchedState:
    """Free the slots in mask [B] and their memory; their requests keep their status. The other
    slots scatter to N, out of range and dropped (an index of -1 would wrap to request N-1)."""
    req = jnp.where(mask & (state.slot_req >= 0), state.slot_req, state.arrival.shape[0])
    table, pool = free_slots(state.block_table, state.block_free, mask)
    slot, reserved = set_few((state.slot, state.reserved), req, (-1, 0))
    return state.replace(
        slot=slot,
        reserved=reserved,
        slot_req=jnp.where(mask, -1, state.slot_req),
        block_table=table,
        block_free=pool,
    )


def release_finished(state: SchedState) -> SchedState:
    """Free every slot whose request has finished, and its memory (iteration-level batching)."""
    done = state.status[jnp.maximum(state.slot_req, 0)] == FINISHED
    return release(state, (state.slot_req >= 0) & done)


def memory_room(state: SchedState, params: PolicyParams) -> Array:
    """KV positions that admission may still grant (inf-like without a memory budget)."""
    mem = state.memory
    if mem is None:
        return jnp.int32(2**30)
    if mem.paged:
        free = state.block_free.sum() - params.watermark_blocks
        return (free * mem.block_size).astype(jnp.int32)
    return jnp.int32(mem.budget_tokens) - state.reserved.sum()


def queue_key(state: SchedState, queue: str) -> Array:
    """[N] each request's place in admission order, as one integer: queued requests first
    (preempted ones at the head), then by `queue`'s rank (its key, arrival, id). Distinct, below
    3N.

    fcfs: arrival order. No starvation: a request waits only for those that arrived before it.
    spf: shortest prompt first. A long prompt can wait forever while shorter ones keep arriving.
    priority: the largest `priority` first. A low-priority request can wait forever likewise.
    """
    n = state.arrival.shape[0]
    head = jnp.where(_queued(state), jnp.where(state.status == PREEMPTED, 0, 1), 2)
    return head * n + state.rank[QUEUE_ORDERS.index(queue)]


def _smallest(key: Array, k: int) -> Array:
    """[..., k] the ids of the k smallest of distinct keys below 3N (over the last axis, so rows
    of keys work alike), in order; ids of 0 past N: of `queue_key`, the queue's first k. Up to
    BY_MINIMA by successive minima, then a top-k, exact in float32 up to 2^24 (a sort beyond),
    where a three-key sort of every request costs a pass far more on XLA's CPU."""
    n = key.shape[-1]
    m = min(k, n)
    if m == 0:
        ids = jnp.zeros((*key.shape[:-1], 0), jnp.int32)
    elif m <= BY_MINIMA and 3 * n * n < 2**31:
        ids = _minima(key, m)
    elif 3 * n <= 2**24:
        ids = jax.lax.top_k(-key.astype(jnp.float32), m)[1]
    else:
        ids = jnp.argsort(key, axis=-1)[..., :m]
    pad = [(0, 0)] * (key.ndim - 1) + [(0, k - m)]
    return jnp.pad(ids, pad).astype(jnp.int32)


# The widths a vmapped admission runs at (`_admission`): XLA's CPU top-k of 64 rows of 200 keys
# costs about 19 us for k = 1, 23 for 2 and 36 for 8, where k successive minima of the keys cost
# about 4, 8 and 39 (a loop of 2,000 calls; 2026-12-06). So 1 and 2 by minima, 8 and B by top-k.
ADMIT_WIDTHS = (1, 2, 8)
BY_MINIMA = 2  # the largest k taken by successive minima


def _minima(key: Array, k: int) -> Array:
    """The ids of the k smallest keys below 3N (over the last axis), in order, ties by id: k
    successive minima of key x N + id (distinct), each the id of its minimum in its low digits."""
    n = key.shape[-1]
    coded = key * n + jnp.arange(n, dtype=jnp.int32)
    ids = []
    for _ in range(k):
        low = jnp.min(coded, axis=-1, keepdims=True)
        ids.append(jax.lax.rem(low, n))  # coded >= 0: the remainder, with no sign fix-up
        coded = jnp.where(coded == low, jnp.iinfo(jnp.int32).max, coded)
    return jnp.concatenate(ids, axis=-1)


def admit(state: SchedState, limit: Array, params: PolicyParams, queue: str) -> SchedState:
    """Put up to `limit` queued requests into free slots in `queue` order, and only while the
    memory budget grants each its need in that order (a request never skips one ahead of it).
    Ranks the queue only when it admits, and in a vmapped sweep admits only as wide as its
    members do (`_admission`)."""
    free = state.slot_req < 0
    n_admit = jnp.minimum(jnp.minimum(_queued(state).sum(), free.sum()), limit)
    return _admission(queue)(state, n_admit, params)


@cache
def _admission(queue: str):
    """(state, n_admit, params) -> the state with the first n_admit of its queue admitted
    (`_choose`, then `_enter`). One run: at the full width B, the queue's top-k only when it
    admits (a `lax.cond`). Under vmap that cond would run the top-k of B for every member on
    every step, and every member's admission at width B (its free slots, needs and cumsums):
    so the batch admits at one width, the smallest of ADMIT_WIDTHS (else B) that holds its
    largest n_admit, and not at all where no member admits; most of a sweep's steps admit one
    request or none in any member. Each width is a `run_if` (a while loop of at most one
    iteration, which updates the state in place) that chooses and enters at that width, its
    scatters W updates a member wide. Until 2026-12-07 a `lax.switch` over the widths returned
    the choice padded to B and its scatters ran after it on every step (a switch that returned
    the state copied its request arrays in and out: 24 copies of a [64, 200] array in the
    64-member step's program, against 2, 2026-12-06); against that, `sim_speed.py`'s sweeps
    over rates took 0.859 and 0.899 of their time, over seeds 0.912 (medians of 7-9 interleaved
    rounds, 2026-12-07). A run alone keeps the cond: with a switch there too, the host loop's
    continuous runs measured 2,253 against 2,467 tok/s (medians of 6, interleaved in one
    process, 2026-12-06), though the jitted schedule alone timed only 5-20 us more a call."""

    @jax.custom_batching.custom_vmap
    def admission(state, n_admit, params):
        b = state.num_slots
        key = queue_key(state, queue)
        none = jnp.zeros(b, jnp.int32)
        head = jax.lax.cond(n_admit > 0, partial(_smallest, k=b), lambda _: none, key)
        return _enter(state, _choose(state, n_admit, params, head))

    @admission.def_vmap
    def _(axis_size, in_batched, state, n_admit, params):
        state, n_admit, params = batched(axis_size, in_batched, (state, n_admit, params))
        b = state.slot_req.shape[-1]
        widths = (*(w for w in ADMIT_WIDTHS if w < b), b)
        most = jnp.max(n_admit)

        def at_width(w):  # every member's admission at width w (its own n_admit and params)
            def admit(state, n_admit, params):
                head = _smallest(queue_key(state, queue), w)
                return _enter(state, _choose(state, n_admit, params, head))

            return lambda state: jax.vmap(admit)(state, n_admit, params)

        out = state
        for lo, w in zip((0, *widths), widths):  # at most one runs: the first that holds most
            out = run_if((most > lo) & (most <= w), at_width(w), out)
        return out, jax.tree.map(lambda _: True, out)

    return admission


def _choose(state: SchedState, n_admit: Array, params: PolicyParams, cand: Array) -> tuple:
    """The first n_admit of `cand` (the queue's first W ids, exact for the first n_admit,
    n_admit <= W), into the first free slots in slot order, in order, while the memory budget
    grants each its need: (request, slot, the slot it would take, admission order, reserved),
    each W wide, a request not admitted as N and its slot as B (dropped by `_enter`)."""
    n, b = state.arrival.shape[0], state.num_slots
    w = cand.shape[0]
    k = jnp.arange(w)
    free = state.slot_req < 0
    if w == 0:
        free_slots_ = k
    elif w <= BY_MINIMA:  # the first w free slots: the smallest of (taken, slot)
        free_slots_ = _minima(jnp.where(free, 0, 1), w)
    else:
        at = jnp.where(free, jnp.cumsum(free) - 1, b)
        free_slots_ = jnp.zeros(b, jnp.int32).at[at].set(jnp.arange(b), mode="drop")[:w]
    tokens = state.prompt_len[cand] + state.num_generated[cand]
    need = state.memory.need(tokens, state.max_new[cand]) if state.memory else jnp.zeros(w)
    fits = (jnp.cumsum(need) if w > 1 else need) <= memory_room(state, params)
    take = (k < n_admit) & fits
    req = jnp.where(take, cand, n)  # n: out of range, dropped by `_enter`
    slot_ids = jnp.where(take, free_slots_, b)
    reserved = jnp.zeros(w, jnp.int32) if state.memory is None or state.memory.paged else need
    return req, slot_ids, free_slots_, state.step * b + k, reserved.astype(jnp.int32)


def _enter(state: SchedState, choice: tuple) -> SchedState:
    """The chosen requests (`_choose`) into their slots: running, in admission order."""
    req, slot_ids, free_slots_, order, reserved = choice
    return state.replace(
        slot_req=state.slot_req.at[slot_ids].set(req, mode="drop"),
        slot=state.slot.at[req].set(free_slots_, mode="drop"),
        status=state.status.at[req].set(RUNNING, mode="drop"),
        admit_order=state.admit_order.at[req].set(order, mode="drop"),
        reserved=state.reserved.at[req].set(reserved, mode="drop"),
    )


def plan_prefill_first(state: SchedState, wait_until: Array) -> Plan:
    """A prefill pass for every running request whose prompt is not yet in the cache; else a
    decode pass for every running request; else an idle plan waiting until `wait_until`.
    A preempted request's prefill recomputes its prompt and the tokens it had generated."""
    req = state.slot_req
    held = req >= 0
    r = jnp.maximum(req, 0)
    running = held & (state.status[r] == RUNNING)
    todo = state.prompt_len[r] + state.num_generated[r] - state.num_computed[r]
    needs_prefill = running & (state.num_computed[r] < state.prompt_len[r])
    any_prefill = needs_prefill.any()
    feeds = jnp.where(any_prefill, needs_prefill, running)
    kind = jnp.where(any_prefill, PREFILL, jnp.where(running.any(), DECODE, IDLE))
    return Plan(
        req=jnp.where(feeds, req, -1),
        num_tokens=jnp.where(feeds, todo, 0).astype(jnp.int32),
        start_pos=jnp.where(feeds, state.num_computed[r], 0).astype(jnp.int32),
        kind=kind.astype(jnp.int32),
        wait_until=jnp.where(kind == IDLE, wait_until, state.now).astype(jnp.float32),
        block_table=state.block_table,
    )


def preempt(state: SchedState, slot: Array) -> SchedState:
    """Evict the request in `slot`: free its memory and queue it to be recomputed."""
    r = state.slot_req[slot]
    state = release(state, jnp.arange(state.num_slots) == slot)
    return state.replace(
        status=state.status.at[r].set(PREEMPTED),
        num_computed=state.num_computed.at[r].set(0),
        num_preemptions=state.num_preemptions.at[r].add(1),
    )


def grow_blocks(state: SchedState, plan: Plan) -> tuple[SchedState, Plan]:
    """Give every fed slot the blocks its tokens need this pass. While the pool is short, preempt
    the running request admitted last (lowest priority first) and drop it from the plan."""
    if state.memory is None or not state.memory.paged:
        return state, plan
    bs = state.memory.block_size

    def shortfall(st, pl):
        target = blocks_for(pl.start_pos + pl.num_tokens, bs)
        have = (st.block_table >= 0).sum(axis=1)
        grow = jnp.where(pl.num_tokens > 0, jnp.maximum(target - have, 0), 0)
        return grow.sum() - st.block_free.sum()

    def running_slots(st):
        r = jnp.maximum(st.slot_req, 0)
        return (st.slot_req >= 0) & (st.status[r] == RUNNING)

    def short(carry):
        st, pl = carry
        return (shortfall(st, pl) > 0) & running_slots(st).any()

    def evict(carry):
        st, pl = carry
        r = jnp.maximum(st.slot_req, 0)
        # Victim: the lowest priority, and among those the most recently admitted.
        running = running_slots(st)
        lowest = running & (st.priority[r] == jnp.min(jnp.where(running, st.priority[r], 2**30)))
        victim = jnp.argmax(jnp.where(lowest, st.admit_order[r], -1))
        st = preempt(st, victim)
        gone = jnp.arange(st.num_slots) == victim
        pl = pl.replace(
            req=jnp.where(gone, -1, pl.req), num_tokens=jnp.where(gone, 0, pl.num_tokens),
            start_pos=jnp.where(gone, 0, pl.start_pos),
        )  # fmt: skip
        return st, pl

    state, plan = jax.lax.while_loop(short, evict, (state, plan))
    fed = plan.num_tokens > 0
    have = (state.block_table >= 0).sum(axis=1)
    target = jnp.where(fed, blocks_for(plan.start_pos + plan.num_tokens, bs), have)
    table, pool = allocate(state.block_table, state.block_free, target)
    state = state.replace(block_table=table, block_free=pool)
    # A pass emptied by preemption idles until now: the evicted requests are queued already.
    emptied = (plan.kind != IDLE) & ~fed.any()
    return state, plan.replace(
        kind=jnp.where(emptied, IDLE, plan.kind),
        wait_until=jnp.where(emptied, state.now, plan.wait_until),
        block_table=table,
    )  # fmt: skip


def static_schedule(
    state: SchedState, params: PolicyParams, queue: str = "fcfs"
) -> tuple[SchedState, Plan]:
    """Request-level batching: a new batch only once every request of the last one has ended."""
    held = state.slot_req >= 0
    occupant_done = state.status[jnp.maximum(state.slot_req, 0)] == FINISHED
    batch_over = jnp.all(~held | occupant_done)
    state = release(state, held & batch_over)
    queued = _queued(state)
    oldest = jnp.min(jnp.where(queued, state.arrival, _INF))
    wake_arrival = next_arrival(state)
    full = queued.sum() >= state.num_slots
    waited = state.now >= oldest + params.max_wait_s
    start_batch = batch_over & (full | waited | (wake_arrival == _INF))
    state = admit(state, jnp.where(start_batch, state.num_slots, 0), params, queue)
    wake = jnp.where(
        queued.any(), jnp.minimum(oldest + params.max_wait_s, wake_arrival), wake_arrival
    )
    return grow_blocks(state, plan_prefill_first(state, wake))


def continuous_schedule(
    state: SchedState, params: PolicyParams, queue: str = "fcfs"
) -> tuple[SchedState, Plan]:
    """Iteration-level batching: finished requests leave at once; arrivals fill free slots."""
    state = admit(release_finished(state), state.num_slots, params, queue)
    return grow_blocks(state, plan_prefill_first(state, next_arrival(state)))


def plan_budgeted(
    state: SchedState, wait_until: Array, params: PolicyParams, whole_prompts: bool
) -> Plan:
    """Decodes first, then prompt tokens under a per-pass token budget (selective batching).

    Every running request whose prompt is cached decodes one token. What is left of
    `params.token_budget` goes to prompts (and recomputations) in admission order:
    `whole_prompts` (Orca) takes a prompt only if all of it fits, stopping at the first that does
    not; otherwise (Sarathi-Serve chunked prefill) each prompt takes a chunk of at most
    `params.threshold` tokens (0: no cap), and at most `params.max_prefills` prompts (0: any
    number) are fed in one pass. All three are traced: a sweep over them is one program.
    """  # fmt: skip
    req = state.slot_req
    r = jnp.maximum(req, 0)
    running = (req >= 0) & (state.status[r] == RUNNING)
    todo = state.prompt_len[r] + state.num_generated[r] - state.num_computed[r]
    prefilling = running & (state.num_computed[r] < state.prompt_len[r])
    decoding = running & ~prefilling
    left = params.token_budget - decoding.sum()
    order = jnp.argsort(jnp.where(prefilling, state.admit_order[r], 2**30), stable=True)
    want = todo[order]
    if not whole_prompts:
        cap = params.threshold
        want = jnp.where(cap > 0, jnp.minimum(want, cap), want)
    want = jnp.where(prefilling[order], want, 0)
    most = params.max_prefills
    want = jnp.where((most == 0) | (jnp.arange(want.shape[0]) < most), want, 0)
    before = jnp.cumsum(want) - want
    if whole_prompts:
        # A preempted request recomputes its prompt and its outputs, which can outgrow the whole
        # budget (a prompt over it is rejected up front): fed whole it would never run, so it
        # takes what the budget leaves, first in order, and the rest in the passes after.
        again = state.num_generated[r][order] > 0
        want = jnp.where(again & (want > params.token_budget), jnp.maximum(left, 0), want)
        fits = jnp.cumsum(want) <= left
        take = jnp.where(jnp.cumprod(fits) > 0, want, 0)  # stop at the first that does not fit
    else:
        take = jnp.clip(left - before, 0, want)
    chunk = jnp.zeros_like(todo).at[order].set(take)
    num_tokens = jnp.where(decoding, 1, chunk).astype(jnp.int32)
    fed = num_tokens > 0
    kind = jnp.where(
        (chunk > 0).any(), MIXED, jnp.where(fed.any(), DECODE, IDLE)
    )  # fmt: skip
    return Plan(
        req=jnp.where(fed, req, -1),
        num_tokens=num_tokens,
        start_pos=jnp.where(fed, state.num_computed[r], 0).astype(jnp.int32),
        kind=kind.astype(jnp.int32),
        wait_until=jnp.where(kind == IDLE, wait_until, state.now).astype(jnp.float32),
        block_table=state.block_table,
    )


def budgeted_schedule(
    state: SchedState, params: PolicyParams, queue: str = "fcfs", whole_prompts: bool = False
) -> tuple[SchedState, Plan]:
    """Iteration-level batching with mixed passes under a token budget (orca and chunked)."""
    state = admit(release_finished(state), state.num_slots, params, queue)
    plan = plan_budgeted(state, next_arrival(state), params, whole_prompts)
    return grow_blocks(state, plan)


def commit(state: SchedState, plan: Plan, tokens: Array, params: PolicyParams) -> SchedState:
    """Apply a pass: its tokens enter the cache; a slot whose known tokens are now all cached emits
    one output token (tokens [B]); a request ends at its output budget or, if honoured, at EOS."""
    n = state.arrival.shape[0]
    active = plan.num_tokens > 0
    req = jnp.where(active, plan.req, n)
    # A fed slot's request is the one it holds (tested), so its fields are read at slot_req, as
    # the plan read them: XLA computes equal gathers once. With `engine.kv_live` read likewise,
    # 64-member sweeps took 0.951 (rates) and 0.967 (seeds) of their time (medians of 15
    # interleaved rounds, 2026-12-07): 11 gathers a step in place of 15.
    r = jnp.maximum(state.slot_req, 0)
    computed = plan.start_pos + plan.num_tokens
    emits = active & (computed == state.prompt_len[r] + state.num_generated[r])
    generated = state.num_generated[r] + emits
    ended = emits & ((generated >= state.max_new[r]) | (tokens == params.eos_id))
    (status,) = set_few((state.status,), jnp.where(ended, req, n), (FINISHED,))
    return state.replace(
        num_computed=state.num_computed.at[req].set(computed, mode="drop"),
        num_generated=state.num_generated.at[req].set(generated, mode="drop"),
        status=status,
        step=state.step + (plan.kind != IDLE),
    )


POLICIES: dict[str, Callable[[SchedState, PolicyParams], tuple[SchedState, Plan]]] = {
    "static": static_schedule,
    "continuous": continuous_schedule,
    "orca": partial(budgeted_schedule, whole_prompts=True),
    "chunked": budgeted_schedule,
}
BUILT_IN = tuple(POLICIES)  # the package's own: their code is in the compile store's keys


def register_policy(
    name: str,
    schedule: Callable[..., tuple[SchedState, Plan]],
    budgeted: bool = False,
) -> None:
    """Make `schedule(state, params, queue="fcfs") -> (state, plan)`, a pure jnp function as
    the policies above are, the policy `name`: `make_policy(name, queue)` in code, and
    `policy.name=name` in a config whose `policy.module` names the file or module that calls
    this (README, "Your own policy"). It shares `commit`, every loop, backend and report.
    `budgeted`: its plans hold mixed passes of at most `params.token_budget` tokens, as orca's
    and chunked's do (the runner then prepares mixed passes of that budget's rows). A name
    already taken by another function is refused: a program compiled for the name would be
    stale."""
    if POLICIES.get(name, schedule) is not schedule:
        raise ValueError(f"register_policy: {name!r} is already a policy (taken: "
                         f"{', '.join(POLICIES)})")  # fmt: skip
    POLICIES[name] = schedule
    add_policy_name(name, budgeted)


def make_policy(name: str, queue: str = "fcfs") -> Policy:
    """The policy `name` admitting in `queue` order (its knobs are PolicyParams, traced). One
    object per name and queue however they are passed (`make_policy("continuous")` is
    `make_policy("continuous", "fcfs")`), so jit caches hold across runs."""
    return _policy(name, queue)


def built_in(policy: Policy) -> tuple | None:
    """A built-in policy of `make_policy` by its arguments, ("make_policy", name, queue): its
    functions are the package's code, which the compile store's keys hold, so what is saved for
    it (a compiled loop, a dry run's shapes) is found again; None for any other, a registered
    one included (its code is not in those keys: never loaded stale)."""
    queue = getattr(policy.schedule, "keywords", {}).get("queue")
    if policy.name in BUILT_IN and queue is not None and make_policy(policy.name, queue) == policy:
        return ("make_policy", policy.name, queue)
    return None


@cache
def _policy(name: str, queue: str) -> Policy:
    return Policy(name=name, schedule=partial(POLICIES[name], queue=queue), commit=commit)
