"""Shared test fixtures: a model small enough that every test runs in seconds on two cores."""

# ruff: noqa: E402 (XLA's flags are set before JAX is imported)

from __future__ import annotations

import dataclasses
import os

# Tests compile hundreds of programs and time none: LLVM's optimisation level 0 cuts their
# compilations by about a third (the suite by a fifth). XLA's HLO passes and fusions are those
# of a user's run; only the generated loops are less optimised. The fusions' loops come from
# XLA's elemental emitter, not its newer MLIR fusion emitters, which take longer to build them
# (test_runner_device_loop alone, back to back: 43 s against 74 s, 2026-12-07; the same HLO
# fusions, 37 of the same kinds in the test model's forward pass, their loops written another
# way). And the dots run in XLA's own
# kernels, not YNNPACK's fusions, whose programs take longer to build, load and first run
# (test_lengths and test_hf: 81 s against 103 s, 2026-12-07, when the suite had grown past its
# 10 minutes in a slow phase). A subprocess whose environment sets `USER_DOTS` keeps YNNPACK's
# fusions, as a user's run has them: test_sharding's, so that passes with those fusions, saved
# whole and loaded again, stay tested. Set before JAX starts its backend; subprocesses of tests
# inherit them.
USER_DOTS = "JAXBATCH_TEST_USER_DOTS"
YNN_OFF = "--xla_cpu_experimental_ynn_fusion_type="
for _flag in ["--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"] + (
    [] if os.environ.get(USER_DOTS) else [YNN_OFF]
):
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

import jax
import numpy as np
import pytest

import jaxbatch.run
from jaxbatch import config, sweep_loop
from jaxbatch.backend import compilation, executables
from jaxbatch.config import Config, EngineConfig, ModelConfig, OutputConfig, PolicyConfig
from jaxbatch.model.spec import ModelSpec
from jaxbatch.model.transformer import init_params
from jaxbatch.sched import policies
from jaxbatch.workload import Workload

# One layer for the runs of the policy, loop and output tests: what they compare (schedules,
# tokens of one run against another) does not depend on depth, and XLA compiles a program of one
# layer in about 70% of the time of two (a device loop over the model, 2026-12-06: compilation
# is about 85% of the suite). The model's own equalities (`spec` below: cached passes against
# the uncached forward pass, paged against slot, chunked against one-shot) keep two layers, so
# that each layer's cache is checked to be its own.
TEST_MODEL = ModelConfig(
    name="custom", vocab_size=256, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_mlp=128,
    max_len=256,
)  # fmt: skip
MODEL_LAYERS = 2


@pytest.fixture(autouse=True, scope="module")
def _fresh_compilations():
    """Each test module's compiled programs are dropped after it: the suite compiles hundreds of
    programs in one process, and late in it XLA's CPU compiler segfaulted (see the README)."""
    yield
    jax.clear_caches()
    executables.clear()
    sweep_loop.clear_programs()  # the device loop's too


@pytest.fixture(autouse=True, scope="module")
def _own_policies_forgotten():
    """A policy a test module registers (a `policy.module` file: test_own_policy, the
    admission_cap preset) is forgotten after it, so each module sees the package's policies
    alone (test_bad_input's message lists them)."""
    names, budgeted = list(config.POLICY_NAMES), list(config.BUDGETED_POLICIES)
    registered, loaded = dict(policies.POLICIES), set(config._loaded_policy_modules)
    yield
    config.POLICY_NAMES[:], config.BUDGETED_POLICIES[:] = names, budgeted
    policies.POLICIES.clear()
    policies.POLICIES.update(registered)
    config._loaded_policy_modules.intersection_update(loaded)
    policies._policy.cache_clear()


@pytest.fixture(autouse=True, scope="session")
def _passes_saved_whole(tmp_path_factory):
    """The runner's compiled passes are saved whole for the session (`executables`, shared by
    the xdist workers), so a test module loads the passes an earlier one compiled instead of
    compiling them again: the same programs, from the same code, in a fraction of the time."""
    root = tmp_path_factory.getbasetemp()
    compilation.use_store((root.parent if root.name.startswith("popen-") else root) / "passes")
    yield
    compilation.use_store(None)


@pytest.fixture(autouse=True)
def _no_persistent_cache(monkeypatch):
    """In-process runs never turn on JAX's persistent compilation cache (a config left at its
    default, `user`, would, and every later compilation of the test process would write the
    user's cache): late in the suite, XLA's CPU compiler then segfaulted compiling a pass, on
    every run (see the README). test_compile_cache checks the cache in subprocesses."""
    monkeypatch.setattr(jaxbatch.run, "use_cache", lambda path: None)


@pytest.fixture(scope="session", params=[2, 4], ids=["kv2", "kv4"])
def spec(request) -> ModelSpec:
    """The test model with grouped-query (2 KV heads for 4 query heads) and plain multi-head
    attention (4 KV heads): the two take different attention paths. Two layers."""
    return dataclasses.replace(TEST_MODEL.spec(), n_kv_heads=request.param, n_layers=MODEL_LAYERS)


@pytest.fixture(scope="session")
def params(spec):
    return init_params(spec, 0)


def make_config(policy: str = "continuous", **engine) -> Config:
    """Tests keep the persistent compilation cache off, so that what an earlier run left on disk
    never changes their compile counts (test_compile_cache turns it on), and run without warm-up
    (each shape compiles on first use: only the shapes a run uses), unless warm-up is what they
    test (`engine.warmup=True`: test_run, the device loop's config test, sharded_runs). Their
    decodes run every slot (`engine.decode_rows=all`): a decode of few slots is a shape of its
    own, compiled, and with every bucket of them the suite took about a minute longer; the tests
    of those decodes ask for them (`decode_rows="compact"`: test_engine, test_batch_invariance,
    the device loop's config test)."""
    engine.setdefault("num_slots", 4)
    engine.setdefault("decode_rows", "all")
    engine.setdefault("compile_cache", "off")
    engine.setdefault("warmup", False)
    return Config(
        model=TEST_MODEL,
        policy=PolicyConfig(name=policy),
        engine=EngineConfig(**engine),
        output=OutputConfig(progress=False, plots=False),
    )


def make_workload(prompt_len, max_new, arrival=None, seed=0) -> Workload:
    prompt_len = np.asarray(prompt_len)
    arrival = np.zeros(len(prompt_len)) if arrival is None else np.asarray(arrival, float)
    return Workload(arrival=arrival, prompt_len=prompt_len, max_new=np.asarray(max_new), seed=seed)


# The files that take longest, longest first (by their tests' durations in one run, 2026-12-07,
# twenty-sixth session: 54 s for test_interrupt down to 17 s for test_launchers, of 611 s in
# all): the suite's two workers (`--dist loadfile`) take files in collection order, so a long
# file collected last kept one worker busy after the other had finished (606 s for the suite in
# alphabetical order, then 551 s with the longest first, minutes apart, eighteenth session).
LONGEST_FIRST = (
    "test_interrupt.py", "test_device_loop.py", "test_runner_device_loop.py", "test_scheduler.py",
    "test_lengths.py", "test_vmap_launcher.py", "test_train.py", "test_mixed.py", "test_engine.py",
    "test_paged.py", "test_compile_cache.py", "test_kernels.py", "test_sharding.py", "test_hf.py",
    "test_batch_invariance.py", "test_launchers.py",
)  # fmt: skip


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within a file
