"""Runs a plan without a model: every slot's token is 0, requests finish by their output budget.

It shares the runner's buckets so padding is counted alike. Its clock is `passes` (each pass costs
one unit); pricing passes with a cost model is future work. It must never touch model weights.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import Array

from jaxbatch.backend.buckets import Buckets, PassShape
from jaxbatch.sched.state import Plan


class Simulator:
    def __init__(self, num_slots: int, max_len: int, min_bucket: int = 16, mixed_rows: int = 0):
        self.buckets = Buckets(
            num_slots=num_slots, max_len=max_len, min_len=min_bucket, mixed_rows=mixed_rows
        )
        self._tokens = jnp.zeros(num_slots, jnp.int32)

    def warmup(self, shapes: list[PassShape], stop=None) -> None:
        """Nothing to compile."""

    def execute(
        self, plan: Plan, shape: PassShape, on_device: Plan | None = None
    ) -> tuple[Array, None]:
        return self._tokens, None

    def decode(self, plan: Plan, shape: PassShape) -> tuple[Array, None]:
        return self._tokens, None

    def outputs(self, num_generated: np.ndarray) -> None:
        return None
