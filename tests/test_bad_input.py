"""Bad config, workload and trace input: one clear message naming the field (or file and line)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from jaxbatch.config import Config, ConfigError, validate
from jaxbatch.workload import WorkloadError, read_text, read_trace


@pytest.mark.parametrize(
    "section, field, value, expect",
    [
        (
            "policy",
            "name",
            "fifo",
            "policy.name='fifo' is not valid: use one of static, continuous, orca, chunked",
        ),
        (
            "model",
            "name",
            "gpt5",
            "model.name='gpt5' is not valid: use one of tiny, small, tiny_trained, custom, hf, "
            "llama2_7b, llama2_13b, llama2_70b, llama3_8b, llama3_70b, mistral_7b, qwen2_5_7b, "
            "gpt3_13b, gpt3_175b, opt_13b, llama3_2_1b",
        ),
        ("engine", "num_slots", 0, "engine.num_slots=0 is not valid: must be > 0"),
        ("model", "d_model", -8, "model.d_model=-8 is not valid: must be > 0"),
        ("workload", "num_requests", 0, "workload.num_requests=0 is not valid: must be > 0"),
        (
            "engine",
            "clock",
            "wall",
            "engine.clock='wall' is not valid: use one of auto, measured, passes, priced",
        ),
        ("model", "n_kv_heads", 3, "model.n_kv_heads=3 is not valid: must divide n_heads=4"),
        # an empty path was the working directory: a run's compile cache went into the repo
        (
            "engine",
            "compile_cache",
            "",
            "engine.compile_cache='' is not valid: user (the default), off, or a folder",
        ),
        (
            "engine",
            "decode_rows",
            "some",
            "engine.decode_rows='some' is not valid: use one of compact, all",
        ),
        (
            "workload",
            "prompt.high",  # the default prompt's length is fixed (32): a range needs a dist
            2000,
            "workload.prompt.high=2000 is not valid: workload.prompt.dist=fixed uses only mean "
            "(32 tokens): set workload.prompt.dist=uniform (or lognormal, clipped to low..high) "
            "to draw lengths in low..high",
        ),
        # NaN fails every comparison, so a check written as `x < 0` let it through: these ran
        # (or failed deep in NumPy) before 2026-12-07
        ("workload", "seed", -1, "workload.seed=-1 is not valid: must be >= 0"),
        ("model", "rope_theta", 0.0, "model.rope_theta=0.0 is not valid: must be > 0"),
        ("model", "norm_eps", -1e-5, "model.norm_eps=-1e-05 is not valid: must be >= 0"),
        (
            "engine",
            "temperature",
            float("nan"),
            "engine.temperature=nan is not valid: must be >= 0 (0 is greedy)",
        ),
        ("policy", "max_wait_s", float("nan"), "policy.max_wait_s=nan is not valid: must be >= 0"),
        (
            "memory",
            "budget_mib",
            float("inf"),
            "memory.budget_mib=inf is not valid: must be a finite number >= 0 (0: one max_len "
            "per slot)",
        ),
    ],
)
def test_config_errors_name_the_field(section, field, value, expect):
    cfg = Config()
    *path, name = f"{section}.{field}".split(".")
    owner = cfg
    for part in path:
        owner = getattr(owner, part)
    setattr(owner, name, value)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert str(err.value) == expect


def test_malformed_trace_rows_name_file_and_line(tmp_path):
    good = "2023-11-16 18:17:03.9799600,4808,10\n"
    cases = {
        "2023-11-16 18:17:04.0319600,abc,8\n": "3: ContextTokens 'abc' is not a non-negative",
        "2023-11-16 18:17:04.0319600,12\n": "3: expected 3 fields, found 2",
        "yesterday,12,8\n": "3: TIMESTAMP 'yesterday' is not 'YYYY-MM-DD HH:MM:SS[.fffffff]'",
        "2023-11-16 18:17:04.0319600,12,-1\n": "3: GeneratedTokens '-1' is not a non-negative",
    }
    for bad, message in cases.items():
        path = tmp_path / "t.csv"
        path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + good + bad + good)
        with pytest.raises(WorkloadError) as err:
            read_trace(path)
        assert str(err.value).startswith(f"{path}:{message}")


def test_an_empty_or_headless_trace_says_which(tmp_path):
    cases = {
        "": ": the file is empty: a trace starts with the header "
            "TIMESTAMP,ContextTokens,GeneratedTokens",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n": ": the trace has no request rows",
        "time,in,out\n": ":1: header ['time', 'in', 'out'] is not "
            "['TIMESTAMP', 'ContextTokens', 'GeneratedTokens']",
    }  # fmt: skip
    for text, message in cases.items():
        path = tmp_path / "t.csv"
        path.write_text(text)
        with pytest.raises(WorkloadError) as err:
            read_trace(path)
        assert str(err.value) == f"{path}{message}"


def test_cli_reports_one_message_and_exit_code_2(tmp_path):
    cmd = [sys.executable, "-m", "jaxbatch", f"hydra.run.dir={tmp_path}", "engine.num_slots=-1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("jaxbatch: error: engine.num_slots=-1 is not valid: must be > 0")
    assert not (tmp_path / "metrics.json").exists()


class _Words:
    """A stand-in tokenizer: one id per whitespace-separated word."""

    def encode(self, text):
        return type("Encoding", (), {"ids": list(range(len(text.split())))})()


@pytest.mark.parametrize(
    "line, expect",
    [
        ('{"prompt": "a b", "max_new_tokens": 0}', "'max_new_tokens' must be >= 1, not 0"),
        ('{"prompt": "a b", "max_new_tokens": 3, "arrival": NaN}', "'arrival' must be a finite"),
        ('{"prompt": "a b", "max_new_tokens": 3, "arrival": -1}', "'arrival' must be a finite"),
        ('{"prompt": 7, "max_new_tokens": 3}', "'prompt' must be a string"),
    ],
)
def test_bad_text_requests_name_file_and_line(tmp_path, line, expect):
    """Before 2026-12-07 an arrival of NaN never arrived: the run failed at max_passes."""
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a b c", "max_new_tokens": 2}\n\n' + line + "\n")
    with pytest.raises(WorkloadError) as err:
        read_text(path, _Words())
    assert str(err.value).startswith(f"{path}:3: {expect}")
    path.write_text('{"prompt": "a b c", "max_new_tokens": 2, "arrival": 0.5}\n')
    w = read_text(path, _Words())
    assert (w.prompt_len.tolist(), w.max_new.tolist(), w.arrival.tolist()) == ([3], [2], [0.5])
