"""The shipped model configs compose through Hydra, validate, and have the sizes they state."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from jaxbatch.cli import CONFIG_DIR
from jaxbatch.config import Config, ConfigError, register, validate


def _composed(model: str) -> Config:
    register()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return OmegaConf.to_object(compose("config", overrides=[f"model={model}"]))


@pytest.mark.parametrize(
    "model, params, kv_per_weight",
    [("tiny", 3_950_848, 0.61), ("small", 26_747_392, 0.17)],
)
def test_model_configs_compose_with_their_stated_sizes(model, params, kv_per_weight):
    cfg = _composed(model)
    validate(cfg)
    spec = cfg.model.spec()
    assert cfg.model.name == model and spec.num_params == params
    # KV values a decode pass reads at 8 slots x 256 cached positions, per weight it reads (the
    # embedding table is gathered, not read whole): the ratio each yaml file states.
    kv = 8 * 256 * spec.kv_bytes_per_token / 4
    weights = spec.num_params - spec.vocab_size * spec.d_model
    assert round(kv / weights, 2) == kv_per_weight


def _composed_with(overrides: list[str]) -> Config:
    register()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return OmegaConf.to_object(compose("config", overrides=overrides))


@pytest.mark.parametrize(
    "model, params",
    [  # Hugging Face's counts of each released checkpoint (Qwen2.5 less its 129,024 QKV biases)
        ("llama2_7b", 6_738_415_616), ("llama2_13b", 13_015_864_320),
        ("llama2_70b", 68_976_648_192), ("llama3_8b", 8_030_261_248),
        ("llama3_70b", 70_553_706_496), ("mistral_7b", 7_241_732_096),
        ("qwen2_5_7b", 7_615_616_512 - 129_024), ("llama3_2_1b", 1_235_814_400),
    ],
)  # fmt: skip
def test_model_presets_have_the_released_sizes(model, params):
    cfg = _composed_with([f"model={model}", "hardware=h100_sxm", "hardware.tensor_parallel=4",
                          "engine.backend=simulator", "engine.clock=priced"])  # fmt: skip
    validate(cfg)
    assert cfg.model.spec().num_params == params


@pytest.mark.parametrize(
    "overrides, clock, loop",
    [
        ([], "measured", "host"),  # the runner's own: wall time, each pass timed
        (["engine.backend=simulator", "hardware=h100_sxm"], "priced", "device"),  # the simulator's
        (["engine.backend=simulator", "engine.clock=passes", "engine.loop=host"], "passes", "host"),
        (["engine.backend=simulator", "engine.clock=passes", "output.checkpoint_every=50"],
         "passes", "host"),  # checkpoints need the host loop
        (["engine.clock=passes", "engine.loop=device"], "passes", "device"),
    ],
)  # fmt: skip
def test_each_backend_has_its_own_default_clock_and_loop(overrides, clock, loop):
    cfg = _composed_with(overrides)
    for field, value in (("clock", clock), ("loop", loop)):
        given = any(o.startswith(f"engine.{field}=") for o in overrides)
        assert getattr(cfg.engine, field) == (value if given else "auto")  # until validated
    validate(cfg)
    assert (cfg.engine.clock, cfg.engine.loop) == (clock, loop)


def test_the_simulator_without_hardware_names_both_ways_out():
    cfg = _composed_with(["engine.backend=simulator"])
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert str(err.value) == (
        "hardware.name='none' is not valid: engine.clock=priced (the simulator's default) needs "
        "hardware to price passes for: use one of a100_40gb, a100_80gb, h100_sxm, h200, tpu_v5e, "
        "tpu_v5p, tpu_v6e, cpu_local, custom; or engine.clock=passes, which counts passes"
    )


@pytest.mark.parametrize(
    "hardware",
    ["a100_40gb", "a100_80gb", "h100_sxm", "h200", "tpu_v5e", "tpu_v5p", "tpu_v6e", "cpu_local"],
)
def test_hardware_presets_compose_and_validate(hardware):
    cfg = _composed_with(
        [f"hardware={hardware}", "engine.backend=simulator", "engine.clock=priced"]
    )
    validate(cfg)
    h = cfg.hardware
    assert h.name == hardware and min(h.peak_tflops, h.memory_gb_s, h.memory_gb, h.link_gb_s) > 0


@pytest.mark.parametrize(
    "name, params",
    [
        ("timeline", {"policy": "static,continuous"}),
        ("memory_budget", {"workload": "azure_conv,synthetic_mixed",
                           "memory": "contiguous,contiguous_exact,paged",
                           "memory.budget_mib": "4,8,16"}),
        ("chunked_prefill", {"policy": "continuous,orca,chunked",
                             "policy.token_budget": "64,256,1024"}),
        ("trained_model", {"policy": "static,continuous,orca,chunked",
                           "memory": "contiguous,paged"}),
        ("admission_cap", {"policy.max_partial_prefills": "0,1,2,4,8"}),
    ],
)  # fmt: skip
def test_each_study_has_an_experiment_preset_that_composes(name, params):
    studies = {p.name for p in (Path(CONFIG_DIR).parent / "experiments").iterdir() if p.is_dir()}
    assert studies == {p.stem for p in (Path(CONFIG_DIR) / "experiment").glob("*.yaml")}
    register()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        hydra_cfg = compose("config", [f"+experiment={name}"], return_hydra_config=True)
        cfg = OmegaConf.to_object(compose("config", [f"+experiment={name}"]))
    assert dict(hydra_cfg.hydra.sweeper.params) == params
    assert hydra_cfg.hydra.sweep.dir.startswith(f"multirun/{name}/")
    validate(cfg)
    assert cfg.output.progress is False


@pytest.mark.parametrize("name, rows", [("code", 200), ("conv", 200)])
def test_the_trace_workloads_read_the_traces_beside_the_checkout_from_any_folder(
    tmp_path, monkeypatch, name, rows
):
    """`workload=azure_code` named ../shared/traces relative to the folder a run started in, so a
    run started anywhere but the checkout found no trace."""
    from jaxbatch.workload import from_config

    monkeypatch.chdir(tmp_path)
    cfg = _composed_with([f"workload=azure_{name}"]).workload
    traces = Path(CONFIG_DIR).parents[1] / "shared" / "traces"
    assert Path(cfg.path).resolve() == (traces / f"azure_llm_2023_{name}.csv").resolve()
    w = from_config(cfg, base_dir=tmp_path)  # the CLI's base: the folder the run started in
    assert len(w) == rows == cfg.limit
