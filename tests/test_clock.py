"""Long clocks: times stay exact to a microsecond for arrivals far beyond float32's reach, and no
latency is ever negative."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxbatch.clock import Clock
from jaxbatch.report.metrics import request_times
from jaxbatch.run import simulate
from jaxbatch.sched.state import init_state
from tests.conftest import make_config, make_workload
from tests.test_device_loop import H100, model_1b

# Two requests a microsecond apart near 1e7 s, where float32 steps by a whole second.
ARRIVALS = [0.0, 3.5, 1e6 + 0.123456, 1e7 + 0.654321, 1e7 + 0.654322, 1e7 + 20.25]


def _first_pass_starts(result, n):
    """Each request's first pass start: where its slot first fed it."""
    rec = result.record
    first = np.full(n, np.nan)
    for p in range(rec.num_passes)[::-1]:
        for b in np.flatnonzero(rec.num_tokens[p] > 0):
            first[rec.req[p, b]] = rec.start[p]
    return first


@pytest.mark.parametrize(
    "engine",
    [
        {"backend": "simulator", "clock": "passes", "loop": "host"},
        {"backend": "simulator", "clock": "passes", "loop": "device"},
        # warmed up: a compilation on the measured clock could outlast the gap to an arrival
        {"backend": "runner", "clock": "measured", "warmup": True},
    ],
    ids=["simulator-passes-host", "simulator-passes-device", "runner-measured"],
)
def test_arrivals_up_to_1e7_keep_microseconds_and_latencies_stay_positive(engine):
    """The host loop's times are exact to a microsecond. The device loop on the passes clock
    keeps float32 times from 0 (the priced clock's exact origin is `test_device_loop`'s): every
    arrival rounded up, never seen early, and a request starts within float32's step of its
    arrival (1 pass near 1e7)."""
    w = make_workload([8] * 6, [3] * 6, arrival=ARRIVALS)
    res = simulate(make_config(num_slots=2, **engine), w)
    times = request_times(res.record, len(ARRIVALS))
    arrival = np.array(ARRIVALS)
    start = _first_pass_starts(res, len(ARRIVALS))
    assert (times.ttft(arrival) > 0).all() and (times.e2e(arrival) > 0).all()
    # Each request but the fifth (a microsecond after the fourth, which holds the clock: on the
    # passes clock, until its pass ends) starts its prompt when it arrives: to a microsecond,
    # or on the device loop's passes clock within a float32 step, never before.
    alone = [0, 1, 2, 3, 5]
    assert (start[alone] >= arrival[alone]).all()
    late = start[alone] - arrival[alone]
    if engine.get("loop") == "device":
        assert (late <= np.spacing(arrival[alone].astype(np.float32))).all()
    else:
        np.testing.assert_allclose(late, 0, rtol=0, atol=1e-6)
    assert start[4] >= arrival[4]
    assert res.outputs is None or all(len(o) == 3 for o in res.outputs)


def test_the_device_never_sees_a_request_before_it_arrives():
    arrival = np.array([1e7 + 0.654321, 1e7 + 0.654322, 2.0**24 + 0.1])
    clock = Clock(arrival)
    state = init_state(arrival, np.ones(3), np.ones(3), np.zeros(3, bool), 1)
    for origin in (0.0, 1e7, 1e7 + 0.654, 2.0**24):
        state = clock.rebase(state, origin)
        rel = np.asarray(state.arrival, np.float64)
        assert (rel >= arrival - origin).all()  # rounded up: never early
        for t in arrival:  # the clock rounds down: at an arrival it never passes a later one
            seen = rel <= np.float64(clock.device(t))
            assert not (seen & (arrival > t)).any()
    near = clock.rebase(state, 1e7)
    rel = np.asarray(near.arrival, np.float64)[:2] + 1e7
    np.testing.assert_allclose(rel, arrival[:2], rtol=0, atol=5e-7)


def test_the_device_loop_keeps_microseconds_on_the_priced_clock():
    """The simulator's device loop moves its origin as the host loop does: the same pass starts
    as the host loop's to a microsecond near 1e7 s, every prompt at its arrival."""
    w = make_workload([8] * 6, [3] * 6, arrival=ARRIVALS)
    cfg = make_config(num_slots=2, backend="simulator", clock="priced")
    cfg.model = model_1b()
    cfg.hardware = H100
    host = simulate(cfg, w)
    device = simulate(
        dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, loop="device")), w
    )
    np.testing.assert_array_equal(device.record.num_tokens, host.record.num_tokens)
    np.testing.assert_allclose(device.record.start, host.record.start, rtol=0, atol=1e-6)
    start, arrival = _first_pass_starts(device, len(ARRIVALS)), np.array(ARRIVALS)
    alone = [0, 1, 2, 3, 5]
    assert (start >= arrival).all()
    np.testing.assert_allclose(start[alone], arrival[alone], rtol=0, atol=1e-6)
    times = request_times(device.record, len(ARRIVALS))
    assert (times.ttft(arrival) > 0).all()
