"""Runs one workload on meshes of 8 simulated CPU devices and prints, per mesh and loop, each
request's tokens and what its steady state compiles, as JSON: `tests/test_sharding.py` runs it in
a subprocess, since the device count is fixed when JAX starts
(XLA_FLAGS=--xla_force_host_platform_device_count=8)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import jax

from jaxbatch import device_loop
from jaxbatch.backend import compilation, executables
from jaxbatch.config import MemoryConfig, MeshConfig, ModelConfig, validate
from jaxbatch.run import build_backend, memory_spec, simulate
from tests.conftest import make_config, make_workload

# The model axis alone, the data axis alone, and both. A second mixed mesh (4x2) was dropped to
# keep the suite inside its 10-minute limit: it cost about 10 s.
MESHES = [(1, 1), (1, 8), (2, 4), (8, 1)]
# Eight KV heads (plain multi-head attention): every model axis up to 8 holds whole heads.
MODEL = ModelConfig(name="custom", vocab_size=256, d_model=128, n_layers=1, n_heads=8,
                    n_kv_heads=8, d_mlp=256, max_len=64)  # fmt: skip


def main() -> None:
    out = {}
    w = make_workload([5, 30, 12, 16, 7, 9, 14, 3, 11, 6], [9, 4, 12, 6, 10, 3, 5, 8, 7, 6])
    runs = [("contiguous", "continuous", "host", m) for m in MESHES]
    # The device loop on the single device, on each axis alone and on a mesh splitting both.
    runs += [("contiguous", "chunked", "device", m) for m in MESHES]
    runs += [("paged", "chunked", "device", m) for m in ((1, 1), (2, 4))]
    for layout, policy, loop, (data, model) in runs:
        # The host loop without warm-up (which compiles every shape the workload might use):
        # it compiles what it uses, and the same run again, the steady state, must compile
        # nothing. The device loop is one program, compiled in its warm-up.
        host = loop == "host"
        cfg = make_config(policy, num_slots=8, clock="passes", loop=loop, warmup=not host)
        cfg.model, cfg.mesh = MODEL, MeshConfig(data=data, model=model)
        cfg.policy.token_budget = 32
        cfg.memory = MemoryConfig(layout=layout, block_size=16)
        validate(cfg)
        res = simulate(cfg, w)
        again = simulate(cfg, w) if host else res
        out[f"{layout}/{policy}/{loop}/{data}x{model}"] = {
            "tokens": [t.tolist() for t in res.outputs],
            "again": [t.tolist() for t in again.outputs],
            "steady_compiles": again.num_compiles if host else res.compiles_after_warmup,
        }
    # Passes, and a device loop's program, saved whole on a mesh of 4 of the 8 devices, then
    # loaded as another process would.
    with tempfile.TemporaryDirectory() as folder:
        for loop in ("host", "device"):
            cfg = make_config("continuous", num_slots=8, clock="passes", warmup=True,
                              compile_cache=folder, loop=loop)  # fmt: skip
            cfg.model, cfg.mesh = MODEL, MeshConfig(data=2, model=2)
            saved = set((Path(folder) / "executables").glob("*.exe"))
            first = simulate(cfg, w)
            executables.clear()
            device_loop.clear_programs()
            jax.clear_caches()
            again = simulate(cfg, w)
            out[f"stored/2x2/{loop}"] = {
                "tokens": [t.tolist() for t in first.outputs],
                "again": [t.tolist() for t in again.outputs],
                "saved": len(set((Path(folder) / "executables").glob("*.exe")) - saved),
                "compiles": again.num_compiles, "hits": again.cache_hits,
            }  # fmt: skip
        compilation.use_cache(None)
    # Where a 2x4 runner puts its arrays (PARAM_RULES, cache_sharding).
    cfg = make_config("continuous", num_slots=8)
    cfg.model, cfg.mesh = MODEL, MeshConfig(data=2, model=4)
    for layout in ("contiguous", "paged"):
        cfg.memory = MemoryConfig(layout=layout, block_size=16)
        runner = build_backend(cfg, w, memory_spec(cfg))
        layer = runner.params["layer_0"]
        out[f"placement/{layout}"] = {
            "q": str(layer["q"]["kernel"].sharding.spec),
            "o": str(layer["o"]["kernel"].sharding.spec),
            "down": str(layer["down"]["kernel"].sharding.spec),
            "embed": str(runner.params["embed"]["embedding"].sharding.spec),
            "cache": str(jax.tree.leaves(runner.cache)[0].sharding.spec),
            "devices": len(jax.tree.leaves(runner.cache)[0].sharding.device_set),
        }  # fmt: skip
    # The runner's device loop is compiled without XLA:CPU's YNNPACK fusions
    # (`compilation.device_loop_options`) in a process whose flags leave them on, as a user's
    # do: a plain matmul here has one, and so do the host loop's passes (XLA's defaults).
    ynn = lambda program: program.as_text().count("__ynn_fusion")  # noqa: E731
    runner.warmup(runner.buckets.for_workload(w.prompt_len, w.max_new)[:2])
    matmul = jax.jit(lambda a: a @ a).lower(jax.numpy.ones((16, 16))).compile()
    out["ynn"] = {
        "plain": ynn(matmul), "passes": [ynn(p) for p in runner._passes.values()],
        "device_loop": [ynn(p) for p in device_loop._programs.values()],
    }  # fmt: skip
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
