"""Process-wide counts of XLA compilations and persistent-cache hits, and the cache itself.

With JAX's persistent compilation cache on, a run whose shapes an earlier run compiled loads them
from disk instead of compiling: a sweep's second job, or a repeated run, warms up in a fraction
of the time. A cache hit is not counted as a compilation. Never compile anything here.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax
from jax import monitoring
from jax.experimental.compilation_cache import compilation_cache

_counts = {"requests": 0, "cache_hits": 0}


def _on_duration(event: str, duration: float, **kwargs) -> None:
    # JAX times a compilation and a load from the persistent cache as one event.
    if event == "/jax/core/compile/backend_compile_duration":
        _counts["requests"] += 1


def _on_event(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _counts["cache_hits"] += 1


monitoring.register_event_duration_secs_listener(_on_duration)
monitoring.register_event_listener(_on_event)


def num_compiles() -> int:
    """XLA compilations in this process so far: every jitted function, eager op and warm-up; an
    executable loaded from the persistent cache is not one."""
    return _counts["requests"] - _counts["cache_hits"]


def cache_hits() -> int:
    """Executables loaded from the persistent compilation cache in this process so far."""
    return _counts["cache_hits"]


def cache_dir(setting: str) -> Path | None:
    """Where `engine.compile_cache` puts compiled passes: `user` (the default) is
    $XDG_CACHE_HOME/jaxbatch/xla (~/.cache/jaxbatch/xla), `off` none, anything else a path."""
    if setting == "off":
        return None
    if setting == "user":
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxbatch" / "xla"
    return Path(setting).expanduser()


def use_cache(path: Path | None) -> None:
    """Turn the persistent compilation cache on at `path` (off for None), for every later
    compilation of the process, however short (JAX's default keeps only those over 1 s)."""
    current = jax.config.jax_compilation_cache_dir
    wanted = None if path is None else str(path)
    if current == wanted:
        return
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    logging.getLogger("jax._src.compilation_cache").setLevel(logging.WARNING)  # no INFO lines
    compilation_cache.set_cache_dir(wanted)
    compilation_cache.reset_cache()  # JAX decides once per process whether a cache is in use
