"""The persistent compilation cache: a repeated run loads every shape the first one compiled."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.backend import compilation, executables
from jaxbatch.backend.buckets import PassShape
from jaxbatch.backend.compilation import cache_hits, num_compiles
from jaxbatch.backend.runner import Runner, Sampling
from jaxbatch.model.transformer import init_params
from jaxbatch.sched.state import DECODE, PREFILL, Plan
from tests.conftest import TEST_MODEL

TINY = [
    "model.vocab_size=256", "model.d_model=64", "model.n_layers=1", "model.n_heads=2",
    "model.n_kv_heads=1", "model.d_mlp=128", "model.max_len=128", "workload.num_requests=6",
    "workload.prompt.dist=uniform", "workload.prompt.low=4", "workload.prompt.high=40",
    "workload.output.dist=uniform", "workload.output.low=1", "workload.output.high=20",
    "engine.num_slots=2", "output.plots=false", "output.progress=false", "output.tokens=true",
]  # fmt: skip


def _run(out: Path, cache: Path) -> dict:
    cmd = [sys.executable, "-m", "jaxbatch", *TINY, f"engine.compile_cache={cache}",
           f"hydra.run.dir={out}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stderr
    return json.loads((out / "metrics.json").read_text())


def test_second_run_compiles_nothing_and_loads_what_the_first_compiled(tmp_path):
    cache = tmp_path / "cache"
    first = _run(tmp_path / "first", cache)
    second = _run(tmp_path / "second", cache)
    assert first["compile_cache"] == str(cache) and first["compile_cache_hits"] == 0
    assert first["num_compiles"] > 0
    assert second["num_compiles"] == 0
    assert second["compile_cache_hits"] == first["num_compiles"]
    tokens = [(tmp_path / run / "tokens.jsonl").read_text() for run in ("first", "second")]
    assert tokens[0] == tokens[1]


def test_a_pass_jax_loaded_from_its_own_cache_is_saved_with_the_bytes_jax_read(tmp_path):
    """Serialized again, an executable JAX loaded from its persistent cache failed once loaded
    (jaxlib 0.10.2 on CPU), so the store saves such a pass with the bytes JAX read: with the
    store emptied, a run finds every pass in JAX's cache and saves each; the next run loads them
    from the store (renewing each file's time) and runs them, and all three give the same
    tokens."""
    cache = tmp_path / "cache"
    first = _run(tmp_path / "first", cache)
    store = cache / "executables"
    saved = sorted(p.name for p in store.glob("*.exe"))
    assert 0 < len(saved) < first["num_compiles"]  # the passes, not the scheduler's programs
    shutil.rmtree(store)
    second = _run(tmp_path / "second", cache)
    assert second["num_compiles"] == 0
    assert second["compile_cache_hits"] == first["num_compiles"]  # all from JAX's cache
    assert sorted(p.name for p in store.glob("*.exe")) == saved  # and the passes saved again
    for path in store.glob("*.exe"):
        os.utime(path, (0, 0))
    third = _run(tmp_path / "third", cache)
    assert (third["num_compiles"], third["compile_cache_hits"]) == (0, first["num_compiles"])
    assert all(path.stat().st_mtime > 0 for path in store.glob("*.exe"))  # loaded from the store
    tokens = {(tmp_path / r / "tokens.jsonl").read_text() for r in ("first", "second", "third")}
    assert len(tokens) == 1


def _runner(spec, params, temperature: float = 0.0) -> Runner:
    prompts = np.arange(4 * spec.max_len).reshape(4, spec.max_len) % spec.vocab_size
    return Runner(spec, params, 4, prompts, np.array([5, 9, 3, 12]), sampling=Sampling(temperature))


def _decode_tokens(runner: Runner) -> np.ndarray:
    """Prefill every request, then one decode pass: the tokens of both passes."""
    slots = np.arange(4, dtype=np.int32)
    lengths = np.array([5, 9, 3, 12], np.int32)
    no_blocks = np.full((4, 0), -1, np.int32)
    prefill = Plan(slots, lengths, 0 * slots, np.int32(PREFILL), np.float32(0), no_blocks)
    first, _ = runner.execute(prefill, runner.buckets.shape_of(prefill))
    plan = Plan(slots, np.ones(4, np.int32), lengths, np.int32(DECODE), np.float32(0), no_blocks)
    second, _ = runner.decode(plan, runner.buckets.decode(13))
    return np.stack([np.asarray(first), np.asarray(second)])


def test_passes_loaded_from_the_store_compute_what_compiled_ones_do(tmp_path, monkeypatch, caplog):
    """A pass is saved whole at its compilation and loaded by a later runner (as another
    process would: executables.clear() drops the process's copies) without compiling; a file
    that cannot be read is compiled again, with a warning, and saved again."""
    spec = TEST_MODEL.spec()
    params = init_params(spec, 0)
    monkeypatch.setattr(compilation, "_store", [tmp_path])
    shapes = [PassShape(4, 16, 0), PassShape(4, 1, 64, True)]
    compiled_tokens = _decode_tokens(_runner(spec, params))
    saved = sorted(tmp_path.glob("*.exe"))
    assert len(saved) == 2  # the prefill and the decode shape
    executables.clear()
    compiles, hits = num_compiles(), cache_hits()
    runner = _runner(spec, params)
    runner.warmup(shapes)
    assert (num_compiles() - compiles, cache_hits() - hits) == (0, 2)
    np.testing.assert_array_equal(_decode_tokens(runner), compiled_tokens)

    saved[0].write_bytes(b"not a program")
    executables.clear()
    jax.clear_caches()  # as in a new process
    hits = cache_hits()
    np.testing.assert_array_equal(_decode_tokens(_runner(spec, params)), compiled_tokens)
    assert cache_hits() - hits == 1  # the other pass
    assert "compiling it again" in caplog.text
    assert saved[0].stat().st_size > 1000  # saved again, whole


def test_a_pass_is_found_by_every_static_argument_and_argument_type():
    """Programs of other static arguments, or of arguments of other types, never share a key;
    equal ones always do."""
    spec = TEST_MODEL.spec()
    params = init_params(spec, 0)
    runner = _runner(spec, params)
    shape = PassShape(4, 1, 64, True)
    args = runner._args(runner._idle_rows(shape))
    static = ("runner._pass", spec, shape, Sampling(), 4, False)
    key = executables._key(static, args)
    assert executables._key(static, args) == key
    other_static = ("runner._pass", spec, shape, Sampling(0.5), 4, False)
    assert executables._key(other_static, args) != key
    wider = (*args[:5], jax.tree.map(lambda x: np.asarray(x, np.int64), args[5]))
    assert executables._key(static, wider) != key
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), args[0])
    assert executables._key(static, (bf16, *args[1:])) != key


def test_programs_of_other_xla_options_are_others_and_an_unknown_option_is_dropped(
    monkeypatch, caplog
):
    """XLA's options are part of a program's key; an option this jaxlib does not know is dropped
    with a warning (an older jaxlib than `compilation.device_loop_options` was measured on), and
    later compilations of the process skip the options."""
    double = jax.jit(lambda x: 2 * x + 1)
    x = jnp.arange(4.0)
    monkeypatch.setattr(compilation, "_store", [None])  # the process's programs only
    plain = executables.compiled(double, ("test.double",), (x,))
    options = {compilation.YNN_FUSIONS: ""}
    other = executables.compiled(double, ("test.double",), (x,), options=options)
    assert other is not plain
    assert executables.compiled(double, ("test.double",), (x,), options=options) is other
    assert executables.compiled(double, ("test.double",), (x,)) is plain
    monkeypatch.setattr(executables, "_unknown_options", [])
    unknown = {"xla_jaxbatch_no_such_option": "1"}
    program = executables.compile_now(double, (x,), unknown)
    np.testing.assert_array_equal(program(x), 2 * x + 1)
    assert "xla_jaxbatch_no_such_option" in caplog.text
    assert len(executables._unknown_options) == 1  # said once, then skipped
    program = executables.compile_now(double, (x,), unknown)
    np.testing.assert_array_equal(program(x), 2 * x + 1)
    assert len(executables._unknown_options) == 1


def test_the_store_drops_the_programs_used_least_recently(tmp_path):
    for i, size in enumerate([300, 200, 100, 400]):  # modified at times 0, 1, 2, 3
        path = tmp_path / f"{i}.exe"
        path.write_bytes(b"x" * size)
        os.utime(path, (i, i))
    os.utime(tmp_path / "0.exe", (9, 9))  # the oldest, loaded since: used last
    names = lambda: sorted(p.name for p in tmp_path.glob("*.exe"))  # noqa: E731
    executables.prune(tmp_path, 800)  # 1000 bytes: the least recently used goes
    assert names() == ["0.exe", "2.exe", "3.exe"]
    executables.prune(tmp_path, 500)
    assert names() == ["0.exe"]
    executables.prune(tmp_path, 0)
    assert names() == []
