"""glibc's malloc is set for loading programs while any thread loads one, and set back after."""

from __future__ import annotations

import platform
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbatch.backend import compilation, executables, host_malloc
from jaxbatch.backend.host_malloc import (
    DEFAULT_MXFAST,
    DEFAULT_TOP_PAD,
    M_MXFAST,
    M_TOP_PAD,
    TOP_PAD,
)

SET = [(M_MXFAST, 0), (M_TOP_PAD, TOP_PAD)]
BACK = [(M_MXFAST, DEFAULT_MXFAST), (M_TOP_PAD, DEFAULT_TOP_PAD)]


@pytest.fixture
def calls(monkeypatch):
    """mallopt's calls, recorded in place of glibc's."""
    seen = []
    monkeypatch.setattr(host_malloc, "_mallopt", lambda: lambda k, v: seen.append((k, v)) or 1)
    return seen


def test_overlapping_loads_set_malloc_once_and_the_last_to_end_sets_it_back(calls):
    entered, leave_first = threading.Event(), threading.Event()

    def first():
        with host_malloc.loading():
            entered.set()
            leave_first.wait(10)

    thread = threading.Thread(target=first)
    thread.start()
    entered.wait(10)
    with host_malloc.loading():  # a second load while the first goes on
        assert calls == SET
        leave_first.set()
        thread.join(10)
        assert calls == SET  # the first ended, this one has not
    assert calls == SET + BACK
    with host_malloc.loading():
        pass
    assert calls == SET + BACK + SET + BACK
    assert host_malloc._loads == 0


def test_a_failed_load_sets_malloc_back(calls):
    with pytest.raises(RuntimeError), host_malloc.loading():
        raise RuntimeError("a file cut short")
    assert calls == SET + BACK and host_malloc._loads == 0


def test_programs_are_loaded_inside_it_and_compute_what_they_did(tmp_path, monkeypatch, calls):
    """A program loaded from the store is deserialized while malloc is set for it."""
    jax_double = jax.jit(lambda x: 2 * x + 1)
    x = jnp.arange(4.0)
    monkeypatch.setattr(compilation, "_store", [tmp_path])
    executables.compiled(jax_double, ("test.host_malloc",), (x,))
    assert calls == []  # compiled, not loaded
    executables.clear()
    inside = []
    load = executables.serialize_executable.deserialize_and_load

    def watched(*args, **kwargs):
        inside.append((host_malloc._loads, list(calls)))
        return load(*args, **kwargs)

    monkeypatch.setattr(executables.serialize_executable, "deserialize_and_load", watched)
    double = executables.compiled(jax_double, ("test.host_malloc",), (x,))
    assert inside == [(1, SET)]
    assert calls == SET + BACK
    np.testing.assert_array_equal(double(x), 2 * x + 1)


def test_glibc_is_found_where_it_is_and_left_alone_where_the_user_tuned_it(monkeypatch):
    host_malloc._mallopt.cache_clear()
    try:
        glibc = platform.libc_ver()[0] == "glibc"  # Python's own reading of the C library
        assert (host_malloc._mallopt() is not None) == glibc
        for name in ("GLIBC_TUNABLES", "MALLOC_TOP_PAD_"):
            monkeypatch.setenv(name, "1")
            host_malloc._mallopt.cache_clear()
            assert host_malloc._mallopt() is None
            monkeypatch.delenv(name)
    finally:
        host_malloc._mallopt.cache_clear()
