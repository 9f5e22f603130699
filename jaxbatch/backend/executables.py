"""Compiled programs (the runner's passes, the device loop's segment) found by what makes them:
kept for the process, and on disk beside JAX's persistent compilation cache, so that a repeated
run loads its programs without tracing them.

JAX's persistent cache (compilation.py) skips XLA's compilation, but not JAX's tracing and
lowering of each program, which its key is computed from: for the tiny model, 0.1-0.3 s a pass
shape, most of a repeated run's warm-up. Here a compiled program is found by a key of everything
it is made from, known before tracing: the source of the jaxbatch package, the versions of jax,
jaxlib, flax and numpy, the devices and the processor, XLA's flags and every JAX setting, the
program's static arguments, and the types, shapes and placements of its arguments. A change to any
of them is another key, so no program compiled from other code or for other inputs is loaded.
A program not found is compiled (through JAX's cache) and saved; one JAX's cache held is saved
with the bytes JAX read (see `_compile`). What a run computes before compiling, from its inputs
alone (the shapes a dry run meets), is kept there too (`remembered`), under a key of the same
things and of the inputs' values.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import io
import logging
import os
import pickle
import platform
from collections.abc import Callable
from functools import cache
from pathlib import Path

import jax
import numpy as np
from jax.experimental import serialize_executable

from jaxbatch.backend.compilation import note_loaded, store, take_thread_entry, thread_cache_hits
from jaxbatch.backend.host_malloc import loading

_log = logging.getLogger(__name__)
_compiled: dict[str, object] = {}  # the process's programs, by key
# The store keeps at most this many bytes: every change to the code makes new keys, so the
# programs used least recently (by modification time, which a load renews) go first.
STORE_BYTES = 2 << 30


def clear() -> None:
    """Drop the process's programs (as `jax.clear_caches` drops jit's)."""
    _compiled.clear()


def compiled(jitted, static: tuple, args: tuple, keep: bool = True, options: dict | None = None):
    """`jitted` (a `jax.jit` function) compiled for `args` with XLA `options`: the process's copy,
    else the store's, else compiled now (and saved). `static` names the program and every static
    argument it was made with (reprs that do not change between processes). `keep=False`: not
    kept for the process here (a caller that keeps its programs itself, with its own bound)."""
    key = _key((*static, sorted((options or {}).items())), args)
    program = _compiled.get(key)
    if program is None:
        program = _load(key) or _compile(jitted, args, key, options)
        if keep:
            _compiled[key] = program
    return program


def _load(key: str):
    folder = store()
    path = folder and folder / f"{key}.exe"
    if path is None or not path.exists():
        return None
    try:
        blob, device_ids = pickle.loads(path.read_bytes())
        by_id = {d.id: d for d in jax.devices()}
        devices = [by_id[i] for i in device_ids]  # a mesh's, in its order: not every device
        with loading():
            program = serialize_executable.deserialize_and_load(*blob, execution_devices=devices)
    except Exception as err:  # a file cut short, or written by something else: compile anew
        _log.warning("could not load the compiled pass %s (%s): compiling it again", path, err)
        return None
    note_loaded()
    with contextlib.suppress(OSError):  # a read-only cache is still read
        os.utime(path)  # used now: pruned last
    return program


def compile_now(jitted, args: tuple, options: dict | None = None):
    """`jitted` lowered for `args` and compiled with XLA `options`; where this jaxlib does not
    know an option (an older one), without them, once said in a warning."""
    lowered = jitted.lower(*args)
    if options and not _unknown_options:
        try:
            return lowered.compile(options)
        except Exception as err:  # jaxlib raises its own error type for an unknown option
            if not any(name in str(err) for name in options):
                raise
            _unknown_options.append(str(err))
            _log.warning("XLA does not take %s (%s): compiling without them", options, err)
    return lowered.compile()


_unknown_options: list[str] = []  # why this jaxlib refused the options, once it did


def _compile(jitted, args: tuple, key: str, options: dict | None = None):
    hits = thread_cache_hits()
    take_thread_entry()
    program = compile_now(jitted, args, options)
    folder = store()
    # A program JAX loaded from its own persistent cache is saved with the bytes JAX read, never
    # serialized again: serialized again, it failed at its first run once loaded ("Function
    # negate_power_fusion not found", jaxlib 0.10.2 on CPU).
    from_jax = thread_cache_hits() > hits
    executable = take_thread_entry() if from_jax else None
    if from_jax and executable is None:
        folder = None  # this JAX does not say what it read: the program stays in JAX's cache
    if folder is not None:
        try:
            devices = program._executable._unloaded_executable.device_list  # as JAX's serialize
            ids = [d.id for d in devices]
            blob = pickle.dumps((_serialized(program, executable), ids))
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f".{key}.{os.getpid()}.tmp"  # renamed whole: no reader sees half
            tmp.write_bytes(blob)
            os.replace(tmp, folder / f"{key}.exe")
            prune(folder, STORE_BYTES)
        except Exception as err:  # a full disk or a read-only folder costs the next run time only
            _log.warning("could not save a compiled pass in %s (%s)", folder, err)
    return program


def _serialized(program, executable: bytes | None) -> tuple:
    """`serialize_executable.serialize(program)`, or (`executable`: the bytes JAX's cache loaded
    it from) the same with those bytes for its executable, as `deserialize_and_load` reads them.
    The second uses JAX's pickler (a private class): where it differs, saving fails, with a
    warning, and the program stays in JAX's cache."""
    if executable is None:
        return serialize_executable.serialize(program)
    se = serialize_executable

    class Pickler(se._JaxPjrtPickler):
        def persistent_id(self, obj):
            if isinstance(obj, (se.xc.LoadedExecutable, se._jax.Executable)):
                return ("exec", executable)
            return super().persistent_id(obj)

    args_info, in_tree = jax.tree_util.tree_flatten(program.args_info)
    with io.BytesIO() as file:
        unloaded = program._executable._unloaded_executable
        Pickler(file).dump((unloaded, args_info, program._no_kwargs))
        return file.getvalue(), in_tree, program.out_tree


def remembered(static: tuple, values, compute: Callable[[], object]):
    """`compute()`, a pure function of the jaxbatch code, of `static` (reprs that do not change
    between processes) and of the arrays and scalars of the pytree `values`: read from the store
    where an earlier process saved it under a key of all of them, else computed and saved (a
    pickle beside the programs, pruned with them). Without a store, computed."""
    folder = store()
    if folder is None:
        return compute()
    path = folder / f"{_key(static, values, values=True)}.val"
    if path.exists():
        try:
            value = pickle.loads(path.read_bytes())
        except Exception as err:  # cut short, or written by something else: computed anew
            _log.warning("could not read %s (%s): computing it again", path, err)
        else:
            with contextlib.suppress(OSError):
                os.utime(path)  # used now: pruned last
            return value
    value = compute()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{path.stem}.{os.getpid()}.tmp"  # renamed whole: no reader sees half
        tmp.write_bytes(pickle.dumps(value))
        os.replace(tmp, path)
    except Exception as err:  # a full disk or a read-only folder costs the next run time only
        _log.warning("could not save %s (%s)", path, err)
    return value


def prune(folder: Path, limit: int) -> None:
    """Delete the least recently used programs and values (`remembered`) in `folder` until it
    holds at most `limit` bytes."""
    files = []
    for path in [*folder.glob("*.exe"), *folder.glob("*.val")]:
        try:
            stat = path.stat()
        except FileNotFoundError:  # another process pruned it
            continue
        files.append((stat.st_mtime, stat.st_size, path))
    total = sum(size for _, size, _ in files)
    for _, size, path in sorted(files, key=lambda f: f[0]):
        if total <= limit:
            break
        path.unlink(missing_ok=True)
        total -= size


def _key(static: tuple, args: tuple, values: bool = False) -> str:
    """The store's key of what `static` names for `args`: their types, shapes and placements
    (a program), or (`values`) their values too (`remembered`)."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    settings = sorted(
        (k, v) for k, v in jax.config.values.items()
        if isinstance(v, (bool, int, float, str, type(None)))
    )  # fmt: skip
    signatures = [_signature(x) for x in leaves]
    if values:
        signatures = [(s, np.asarray(x).tobytes()) for s, x in zip(signatures, leaves)]
    made_of = (_code(), settings, repr(static), str(tree), signatures)
    return hashlib.sha256(repr(made_of).encode()).hexdigest()[:40]


def abstract(x):
    """An array's type, shape and placement (what a program is compiled for): an array on the
    default device, not placed there (`committed`), stays unplaced, as are the outputs of a
    program compiled for it (a placed output would make the scheduler's step compile again)."""
    if isinstance(x, jax.Array):
        sharding = x.sharding if x.committed else None
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=x.weak_type)
    return x


def _signature(x) -> tuple:
    x = abstract(x)  # an array and its type find the same program
    if isinstance(x, jax.ShapeDtypeStruct):
        return (x.shape, str(x.dtype), x.weak_type, repr(x.sharding))
    if isinstance(x, (np.ndarray, np.generic)):
        return (x.shape, str(x.dtype))
    return (type(x).__name__,)  # a Python scalar: a weakly typed value of its type


@cache
def _code() -> tuple:
    """What every program of the process is made from, whatever its arguments."""
    package = Path(__file__).resolve().parents[1]
    source = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        source.update(str(path.relative_to(package)).encode() + path.read_bytes())
    versions = [importlib.metadata.version(p) for p in ("jax", "jaxlib", "flax", "numpy")]
    devices = [(d.platform, d.device_kind, d.id) for d in jax.devices()]
    client = jax.devices()[0].client
    return (
        source.hexdigest(), versions, devices, client.platform_version, _processor(),
        os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", ""),
    )  # fmt: skip


def _processor() -> str:
    """The CPU's model and flags (code compiled for the host's CPU may use all its features)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "|".join(sorted({x for x in lines if x.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() or platform.machine()
