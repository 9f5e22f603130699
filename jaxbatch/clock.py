"""The host loop's clock: exact float64 times on the host, float32 times near an origin on the
device.

The scheduler state holds times in float32 (fast everywhere, TPUs included), which resolves a
microsecond only below 8 s: an arrival at 1e6 s would be rounded by 0.06 s and a request admitted
before it arrived. So the device's times are relative to an origin that the host moves forward as
the clock runs (`rebase`), and are rounded so that the device never sees a request arrive early:
arrivals up, the clock down. Every reported time is the host's float64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.sched.state import SchedState, float32_up

# The device's times stay within WINDOW of the origin, where a float32 step is under 0.5 us.
WINDOW = 4.0


def _down(x: float) -> np.float32:
    y = np.float32(x)
    return np.nextafter(y, np.float32(-np.inf)) if y > x else y


class Clock:
    def __init__(self, arrival: np.ndarray):
        self.arrival = np.asarray(arrival, np.float64)
        self.origin = 0.0

    def device(self, t: float) -> np.float32:
        """A host time as the device sees it: relative to the origin, rounded down."""
        return _down(t - self.origin)

    def host(self, t: float) -> float:
        """A device time (such as an idle plan's `wait_until`) on the host."""
        return self.origin + float(t)

    def near(self, t: float) -> bool:
        """Whether the device resolves time t to a microsecond."""
        return abs(t - self.origin) <= WINDOW

    def rebase(self, state: SchedState, origin: float) -> SchedState:
        """Move the origin to `origin` (at or before every time the device will next see):
        the state's arrivals, relative to it and rounded up."""
        self.origin = float(origin)
        arrival = jnp.asarray(float32_up(self.arrival - self.origin))
        placed = getattr(state.arrival, "sharding", None)
        if placed is not None and len(placed.device_set) > 1:  # on a mesh: stay there
            arrival = jax.device_put(arrival, placed)
        return state.replace(arrival=arrival)

    def lookahead(self, wait_until: np.float32) -> float:
        """An origin from which to look again at a far idle wake: the device's `wait_until` this
        far from the origin is coarse (up to a float32 step late), so the next look starts a
        step and half a window before it."""
        step = float(np.spacing(np.float32(abs(wait_until))))
        return self.host(wait_until) - 2 * step - WINDOW / 2
