"""A policy of one's own: continuous batching that admits at most a few requests a pass.

`continuous` fills every free slot before each pass, so a burst of arrivals becomes one large
prefill pass that every running decode waits for. `capped` admits at most
`policy.max_partial_prefills` queued requests a pass (0: every free slot, which is `continuous`),
so a burst is prefilled over several smaller passes. It is built from the package's public steps
and registered under a name a config can give (README, "Your own policy"):

    jaxbatch policy.module=experiments/admission_cap/policy.py policy.name=capped \\
        policy.max_partial_prefills=2

The cap is a traced knob (`PolicyParams.max_prefills`), so a simulated sweep over it runs as
one vmapped program (`hydra/launcher=vmap`).
"""

import jax.numpy as jnp

from jaxbatch.sched.policies import (
    admit,
    grow_blocks,
    next_arrival,
    plan_prefill_first,
    register_policy,
    release_finished,
)


def capped_schedule(state, params, queue="fcfs"):
    """Iteration-level batching whose prefill passes admit at most `params.max_prefills` new
    requests (0: as many as there are free slots)."""
    cap = jnp.where(params.max_prefills > 0, params.max_prefills, state.num_slots)
    state = admit(release_finished(state), cap, params, queue)
    return grow_blocks(state, plan_prefill_first(state, next_arrival(state)))


register_policy("capped", capped_schedule)
