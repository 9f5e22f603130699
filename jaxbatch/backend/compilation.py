"""Process-wide counts of XLA compilations and compile-cache hits, and the cache itself.

With the compile cache on, a run whose shapes an earlier run compiled loads them from disk
instead of compiling: a sweep's second job, or a repeated run, warms up in a fraction of the
time. The cache is JAX's persistent compilation cache, and in its `executables/` folder the
runner's passes and the device loop's programs whole (executables.py), which load without
tracing. A cache hit is not counted as a compilation. Never compile anything here.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import jax
from jax import monitoring
from jax.experimental.compilation_cache import compilation_cache

_counts = {"requests": 0, "cache_hits": 0, "loaded": 0}
_lock = threading.Lock()  # warm-up compiles on several threads
_store: list[Path | None] = [None]  # the folder of whole compiled passes (None: off)


def _count(name: str) -> None:
    with _lock:
        _counts[name] += 1


def _on_duration(event: str, duration: float, **kwargs) -> None:
    # JAX times a compilation and a load from the persistent cache as one event.
    if event == "/jax/core/compile/backend_compile_duration":
        _count("requests")


_thread = threading.local()  # `hits`: executables this thread loaded from JAX's cache; `entry`
# the serialized executable JAX's cache last gave this thread (see `_keep_entries`)


def _on_event(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _count("cache_hits")
        _thread.hits = getattr(_thread, "hits", 0) + 1  # JAX reports it on the compiling thread


monitoring.register_event_duration_secs_listener(_on_duration)
monitoring.register_event_listener(_on_event)


def _keep_entries() -> None:
    """Keep, per thread, the serialized executable of each entry JAX's persistent cache reads (it
    splits the entry with `extract_executable_and_time` and then loads it): the store saves a
    program JAX loaded from its cache with these bytes (executables.py). A JAX without that
    function keeps nothing, and such programs are then not saved."""
    try:
        from jax._src import compilation_cache as jax_cache  # private
    except ImportError:
        return
    extract = getattr(jax_cache, "extract_executable_and_time", None)
    if extract is None or getattr(extract, "keeps_entries", False):
        return

    def extracting(entry: bytes):
        executable, compile_time = extract(entry)
        _thread.entry = executable
        return executable, compile_time

    extracting.keeps_entries = True
    jax_cache.extract_executable_and_time = extracting


_keep_entries()


def num_compiles() -> int:
    """XLA compilations in this process so far: every jitted function, eager op and warm-up; an
    executable loaded from the persistent cache is not one."""
    return _counts["requests"] - _counts["cache_hits"]


def cache_hits() -> int:
    """Executables loaded from the compile cache (JAX's or the passes' folder) in this process
    so far."""
    return _counts["cache_hits"] + _counts["loaded"]


def thread_cache_hits() -> int:
    """Executables this thread has loaded from JAX's persistent cache so far."""
    return getattr(_thread, "hits", 0)


def take_thread_entry() -> bytes | None:
    """The serialized executable JAX's persistent cache last gave this thread (None: none since
    the last call), forgotten as it is taken."""
    entry, _thread.entry = getattr(_thread, "entry", None), None
    return entry


# XLA:CPU's option naming the library (YNNPACK) fusions it builds; empty: none.
YNN_FUSIONS = "xla_cpu_experimental_ynn_fusion_type"


def device_loop_options() -> dict[str, str]:
    """XLA options of the runner's device loop (one program holding every pass it runs), chosen
    by platform here only. On the CPU, no YNNPACK fusions (jaxlib 0.10.2 builds them for dots
    and reductions by default): XLA's CPU client loads a program in time that grows faster than
    its size, and a repeated run of realistic chunked (tiny model) then loads and first runs its
    program in less time (warm-up 2.14-2.35 s against 2.80-3.20 s) at the same throughput
    (0.996-0.999 of it, side by side). The host loop's passes, each a program of its own, keep
    XLA's defaults: without the fusions realistic continuous ran 0.94-0.97 of its throughput
    there (2026-12-07, README's Compilation). Elsewhere nothing changes."""
    return {YNN_FUSIONS: ""} if jax.default_backend() == "cpu" else {}


def note_loaded() -> None:
    """Count a compiled pass loaded from `store()`."""
    _count("loaded")


def store() -> Path | None:
    """Where whole compiled passes are saved and loaded (executables.py): the cache's
    `executables/` folder, or None with the cache off."""
    return _store[0]


def use_store(path: Path | None) -> None:
    """Save whole compiled passes in `path` and load them from it (None: off)."""
    _store[0] = path


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
    compilation of the process, however short (JAX's default keeps only those over 1 s), and
    the store of whole passes in its `executables/` folder."""
    use_store(None if path is None else path / "executables")
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
