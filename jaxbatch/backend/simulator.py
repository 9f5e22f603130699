"""Runs a plan without a model: every slot's token is 0, requests finish by their output budget.

It shares the runner's buckets (`min_context`: the runner's cache's floor, `kvcache.min_read`) so
padding is counted alike. With `priced` (a Hardware entry and a tensor-parallel degree) it prices
each pass with the cost model (`engine.clock=priced`); otherwise the clock counts passes. It must
never touch model weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from jaxbatch.backend.buckets import Buckets, PassShape
from jaxbatch.backend.cost_model import Hardware, price, runner_shape
from jaxbatch.model.spec import ModelSpec
from jaxbatch.sched.state import Plan


class Simulator:
    def __init__(
        self,
        num_slots: int,
        max_len: int,
        min_bucket: int = 16,
        mixed_rows: int = 0,
        spec: ModelSpec | None = None,
        priced: tuple[Hardware, int] | None = None,
        min_context: int = 0,
        compact: bool = True,
    ):
        self.buckets = Buckets(num_slots, max_len, min_bucket, mixed_rows, min_context, compact)
        # What the device step's program depends on: runs with equal keys share their compiled
        # device loop (`device_loop.run_device`).
        self.program_key = (Simulator, self.buckets, priced and (spec, *priced))
        self.compile_options = {}  # XLA's defaults (the runner's: `device_loop_options`)
        self._tokens = jnp.zeros(num_slots, jnp.int32)
        self._price = self._priced = None
        if priced is not None:
            hw, tp = priced

            def at_shape(plan: Plan, padded) -> Array:  # jnp: a pass's price at its shape
                sampled = plan.num_tokens > 0
                return price(spec, hw, plan.num_tokens, plan.start_pos, sampled, tp, padded,
                             plan.kind)  # fmt: skip

            def host_price(num_tokens, start_pos, kind) -> Array:
                plan = Plan(num_tokens, num_tokens, start_pos, kind, jnp.float32(0), None)
                return at_shape(plan, runner_shape(self.buckets, plan, jnp))

            self._price, self._priced = jax.jit(host_price), at_shape

    num_branches = 0  # the device loop's warm-up: nothing to run once
    runs_ahead = False  # each pass at its plan's own shape, the one it is priced at (`engine`)

    def consts(self) -> tuple:
        """The device step's constants: the mixed passes' top row bucket (the token budget's),
        an array, so that members of a sweep over token budgets share one program."""
        return (np.int32(self.buckets.mixed_rows),)

    def carry(self) -> tuple:
        return ()

    def keep(self, carry: tuple) -> None:
        pass

    def device_step(self, consts, carry, plan: Plan, skip, warm_branch):
        """The device loop's pass (jnp, pure): every slot's token (0), the pass's duration (its
        price on the target hardware, or one pass on the `passes` clock) and its shape by the
        host loop's rule. Has no device state, so `skip` and `warm_branch` change nothing."""
        (mixed_rows,) = consts
        padded = runner_shape(self.buckets, plan, jnp, mixed_rows)  # priced and recorded
        cost = jnp.float32(1.0) if self._priced is None else self._priced(plan, padded)
        zeros = jnp.zeros(plan.num_tokens.shape, jnp.int32)
        return carry, zeros, cost.astype(jnp.float32), (padded.rows, padded.tokens, padded.context)

    def warmup(self, shapes: list[PassShape], stop=None) -> None:
        """Nothing to compile but the cost model."""
        if self._price is not None:
            zeros = np.zeros(self._tokens.shape[0], np.int32)
            jax.block_until_ready(self._price(zeros, zeros, np.int32(0)))

    def price(self, plan: Plan) -> float:
        """Seconds the pass of a host-side plan takes on the target hardware."""
        return float(self._price(plan.num_tokens, plan.start_pos, np.int32(plan.kind)))

    def execute(
        self, plan: Plan, shape: PassShape, on_device: Plan | None = None
    ) -> tuple[Array, None]:
        return self._tokens, None

    def decode(self, plan: Plan, shape: PassShape) -> tuple[Array, None]:
        return self._tokens, None

    def outputs(self, num_generated: np.ndarray) -> None:
        return None
