"""Batching policies as pure jax.numpy functions: schedule(state, params) and commit(...).

`static` holds a batch in its slots until its slowest request ends (request-level batching);
`continuous` frees a slot the moment its request ends and refills it before the next pass
(iteration-level batching, Orca). Both admit in FCFS order. Nothing here may touch the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp
from flax import struct
from jax import Array

from jaxbatch.sched.state import (
    DECODE,
    FINISHED,
    IDLE,
    PREEMPTED,
    PREFILL,
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


class Policy(NamedTuple):
    name: str
    schedule: Callable[[SchedState, PolicyParams], tuple[SchedState, Plan]]
    commit: Callable[[SchedState, Plan, Array, PolicyParams], SchedState]


def _queued(state: SchedState) -> Array:
    """[N] requests that may be admitted now: waiting or preempted, and arrived."""
    return ((state.status == WAITING) | (state.status == PREEMPTED)) & (state.arrival <= state.now)


def _next_arrival(state: SchedState) -> Array:
    future = (state.status == WAITING) & (state.arrival > state.now)
    return jnp.min(jnp.where(future, state.arrival, _INF))


def release(state: SchedState, mask: Array) -> SchedState:
    """Free the slots in mask [B]; their requests keep their status."""
    req = jnp.where(mask, state.slot_req, -1)
    slot = state.slot.at[req].set(-1, mode="drop")
    return state.replace(slot=slot, slot_req=jnp.where(mask, -1, state.slot_req))


def admit_fcfs(state: SchedState, limit: Array) -> SchedState:
    """Put up to `limit` queued requests into free slots, earliest arrival first (ties: low id)."""
    n, b = state.arrival.shape[0], state.num_slots
    queued = _queued(state)
    order = jnp.argsort(jnp.where(queued, state.arrival, _INF), stable=True)
    free = state.slot_req < 0
    free_slots = jnp.argsort(~free, stable=True)  # free slots first, in slot order
    k = jnp.arange(b)
    n_admit = jnp.minimum(jnp.minimum(queued.sum(), free.sum()), limit)
    take = k < n_admit
    cand = order.at[k].get(mode="fill", fill_value=0) if n < b else order[:b]
    req = jnp.where(take, cand, n)  # n: out of range, dropped below
    slot_ids = jnp.where(take, free_slots, b)
    return state.replace(
        slot_req=state.slot_req.at[slot_ids].set(req, mode="drop"),
        slot=state.slot.at[req].set(free_slots, mode="drop"),
        status=state.status.at[req].set(RUNNING, mode="drop"),
    )


def plan_prefill_first(state: SchedState, wait_until: Array) -> Plan:
    """A prefill pass for every running request whose prompt is not yet in the cache; else a
    decode pass for every running request; else an idle plan waiting until `wait_until`."""
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
    )


def static_schedule(state: SchedState, params: PolicyParams) -> tuple[SchedState, Plan]:
    """Request-level batching: a new batch only once every request of the last one has ended."""
    held = state.slot_req >= 0
    occupant_done = state.status[jnp.maximum(state.slot_req, 0)] == FINISHED
    batch_over = jnp.all(~held | occupant_done)
    state = release(state, held & batch_over)
    queued = _queued(state)
    oldest = jnp.min(jnp.where(queued, state.arrival, _INF))
    next_arrival = _next_arrival(state)
    full = queued.sum() >= state.num_slots
    waited = state.now >= oldest + params.max_wait_s
    start_batch = batch_over & (full | waited | (next_arrival == _INF))
    state = admit_fcfs(state, jnp.where(start_batch, state.num_slots, 0))
    wake = jnp.where(
        queued.any(), jnp.minimum(oldest + params.max_wait_s, next_arrival), next_arrival
    )
    return state, plan_prefill_first(state, wake)


def continuous_schedule(state: SchedState, params: PolicyParams) -> tuple[SchedState, Plan]:
    """Iteration-level batching: finished requests leave at once; arrivals fill free slots, FCFS."""
    occupant_done = state.status[jnp.maximum(state.slot_req, 0)] == FINISHED
    state = release(state, (state.slot_req >= 0) & occupant_done)
    state = admit_fcfs(state, state.num_slots)
    return state, plan_prefill_first(state, _next_arrival(state))


def commit(state: SchedState, plan: Plan, tokens: Array, params: PolicyParams) -> SchedState:
    """Apply a pass: its tokens enter the cache; a slot whose known tokens are now all cached emits
    one output token (tokens [B]); a request ends at its output budget or, if honoured, at EOS."""
    n = state.arrival.shape[0]
    active = plan.num_tokens > 0
    req = jnp.where(active, plan.req, n)
    r = jnp.minimum(req, n - 1)
    computed = plan.start_pos + plan.num_tokens
    emits = active & (computed == state.prompt_len[r] + state.num_generated[r])
    generated = state.num_generated[r] + emits
    ended = emits & ((generated >= state.max_new[r]) | (tokens == params.eos_id))
    status = jnp.where(ended, FINISHED, state.status[r])
    return state.replace(
        num_computed=state.num_computed.at[req].set(computed, mode="drop"),
        num_generated=state.num_generated.at[req].set(generated, mode="drop"),
        status=state.status.at[req].set(status, mode="drop"),
        step=state.step + (plan.kind != IDLE),
    )


POLICIES: dict[str, Callable[[SchedState, PolicyParams], tuple[SchedState, Plan]]] = {
    "static": static_schedule,
    "continuous": continuous_schedule,
}


def make_policy(name: str) -> Policy:
    return Policy(name=name, schedule=POLICIES[name], commit=commit)
