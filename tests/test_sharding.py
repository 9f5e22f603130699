"""Many devices: 8 simulated CPU devices in a subprocess (`tests/sharded_runs.py`). Tokens equal
the single-device run for meshes 1x8, 2x4 and 8x1 on the host loop and on the device loop (the
paged layout on 2x4), and the steady state compiles nothing; parameters and caches sit where
the partition rules say; a mesh the model or the slots cannot split is refused naming the valid
sizes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxbatch.config import ConfigError, MeshConfig, validate
from tests.conftest import USER_DOTS, YNN_OFF, make_config
from tests.sharded_runs import MODEL

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def runs() -> dict:
    # conftest's flags but with YNNPACK's fusions, as a user's run has them (but for the
    # runner's device loop: `compilation.device_loop_options`)
    flags = os.environ["XLA_FLAGS"].replace(YNN_OFF, "")
    flags = f"{flags} --xla_force_host_platform_device_count=8"
    env = dict(os.environ, XLA_FLAGS=flags, **{USER_DOTS: "1"})
    proc = subprocess.run([sys.executable, "-m", "tests.sharded_runs"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_tokens_on_every_mesh_equal_the_single_device_run(runs):
    groups = {k.rsplit("/", 1)[0] for k in runs if not k.startswith(("placement", "stored", "ynn"))}
    assert groups == {"contiguous/continuous/host", "contiguous/chunked/device",
                      "paged/chunked/device"}  # fmt: skip
    for key, run in runs.items():
        if key.startswith(("placement", "stored", "ynn")):
            continue
        alone = runs[key.rsplit("/", 1)[0] + "/1x1"]
        assert run["tokens"] == alone["tokens"] == run["again"], key
        assert sum(map(len, run["tokens"])) == 9 + 4 + 12 + 6 + 10 + 3 + 5 + 8 + 7 + 6
        assert run["steady_compiles"] == 0, key  # the steady state compiles nothing
    meshes = {k.rsplit("/", 1)[1] for k in runs if k.startswith("contiguous/continuous/host")}
    assert meshes == {"1x1", "1x8", "2x4", "8x1"}
    assert {k for k in runs if "/device/" in k} == {
        "contiguous/chunked/device/1x1", "contiguous/chunked/device/1x8",
        "contiguous/chunked/device/2x4", "contiguous/chunked/device/8x1",
        "paged/chunked/device/1x1", "paged/chunked/device/2x4",
    }  # fmt: skip


def test_passes_saved_on_part_of_the_devices_load_onto_those_devices(runs):
    """A 2x2 mesh of the 8 devices: its passes, and the device loop's program, loaded from the
    compile cache's store, run on the mesh's 4 devices and give the single-device tokens."""
    alone = runs["contiguous/continuous/host/1x1"]["tokens"]
    for loop in ("host", "device"):
        stored = runs[f"stored/2x2/{loop}"]
        assert stored["tokens"] == stored["again"] == alone, loop
        assert stored["saved"] > 0 and stored["compiles"] == 0, loop
        assert stored["hits"] >= stored["saved"], loop
    assert runs["stored/2x2/device"]["saved"] == 1  # the loop's program (no pass of its own)


def test_the_device_loop_is_compiled_without_ynnpack_fusions_on_the_cpu(runs):
    ynn = runs["ynn"]
    assert ynn["plain"] >= 1  # this process's flags leave XLA's fusions on
    assert len(ynn["passes"]) == 2 and min(ynn["passes"]) >= 1  # the host loop's: XLA's defaults
    assert len(ynn["device_loop"]) >= 1 and set(ynn["device_loop"]) == {0}


def test_parameters_and_caches_sit_where_the_rules_say(runs):
    cache_specs = {  # slot layout [slots, kv_heads, ..]; paged pool [kv_heads, blocks, ..]
        "contiguous": "P('data', 'model', None, None)", "paged": "P('model', None, None, None)"
    }  # fmt: skip
    for layout, cache_spec in cache_specs.items():
        placed = runs[f"placement/{layout}"]
        assert placed["q"] == "P(None, 'model', None)"  # heads over the model axis
        assert placed["o"] == "P('model', None, None)"
        assert placed["down"] == "P('model', None)"  # the MLP's inner dimension
        assert placed["embed"] == "P()"  # replicated
        assert placed["cache"] == cache_spec
        assert placed["devices"] == 8


@pytest.mark.parametrize(
    "data,model,message",
    [
        (1, 3, "mesh.model=3 is not valid: must divide model.n_kv_heads=8: valid model axes "
               "are [1, 2, 4, 8]"),
        (3, 1, "mesh.data=3 is not valid: must divide engine.num_slots=8 (the slot layout "
               "splits slots): one of [1, 2, 4, 8]"),
        (2, 2, "mesh.data=2 is not valid: a 2x2 mesh needs 4 devices; 1 visible"),
    ],
)  # fmt: skip
def test_a_mesh_the_model_or_slots_cannot_split_is_refused(data, model, message):
    cfg = make_config("continuous", num_slots=8)
    cfg.model, cfg.mesh = MODEL, MeshConfig(data=data, model=model)
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(cfg)
