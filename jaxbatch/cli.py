"""The Hydra entry point (`jaxbatch`): runs a config (`run.simulate`), writes its outputs and
prints the summary.

`execute(cfg, out_dir)` is the whole run without Hydra, for tests and scripts. Bad input stops
with one message naming the field (exit code 2) before anything compiles.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import hydra
import numpy as np
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from jaxbatch import resume, tasks
from jaxbatch.backend.compilation import cache_dir
from jaxbatch.config import CONFIG_DIR, Config, ConfigError, register, validate
from jaxbatch.engine import RunResult
from jaxbatch.interrupt import Interrupt, never
from jaxbatch.report import files
from jaxbatch.report.metrics import request_times, summarize
from jaxbatch.report.plots import plot_memory, plot_timeline
from jaxbatch.report.provenance import provenance
from jaxbatch.report.sweep import summarize_sweep
from jaxbatch.report.trace import write_trace
from jaxbatch.run import memory_spec, rejections, simulate
from jaxbatch.sched.state import FINISHED, INTERRUPTED, REJECTED
from jaxbatch.workload import WorkloadError, from_config, tokenizer

register()


def execute(
    cfg: Config,
    out_dir: Path,
    base_dir: Path | None = None,
    stop: Callable[[], bool] = never,
    result: RunResult | None = None,
) -> dict:
    """Validate, build, run and write every output file into out_dir; returns metrics.json.
    A run that `stop()` ends early writes every file for the passes done; the requests it left
    unfinished are `interrupted` in requests.csv, and metrics.json says `"interrupted": true`.
    `result`: the run already done (a member of a swept program, see `vmap_launcher`)."""
    if cfg.resume:
        cfg = resume.config_of(cfg.resume)
    validate(cfg)
    workload = from_config(cfg.workload, base_dir, cfg.model.path)
    saves = out_dir / "checkpoint" if cfg.engine.loop == "host" else None
    result = result or simulate(cfg, workload, stop=stop, checkpoint_dir=saves)
    spec, rec, final = cfg.model.spec(), result.record, result.final
    memory = memory_spec(cfg)
    status = np.asarray(final.status)
    if result.interrupted:
        status = np.where((status == FINISHED) | (status == REJECTED), status, INTERRUPTED)
    metrics = {
        "policy": cfg.policy.name,
        "backend": cfg.engine.backend,
        "clock": cfg.engine.clock,
        "hardware": cfg.hardware.name,  # what a priced clock priced passes for (none: no pricing)
        "tensor_parallel": cfg.hardware.tensor_parallel,
        "loop": cfg.engine.loop,
        "num_slots": cfg.engine.num_slots,
        "num_requests": len(workload),
        "num_rejected": int((status == REJECTED).sum()),
        "interrupted": result.interrupted,
        "num_preemptions": int(np.asarray(final.num_preemptions).sum()),
        "memory_layout": memory.layout,
        "kv_budget_tokens": memory.capacity_tokens,
        "kv_budget_mib": memory.capacity_tokens * spec.kv_bytes_per_token / 2**20,
        "kv_num_blocks": memory.num_blocks,
        "kv_max_len_reservations": memory.capacity_tokens // spec.max_len,
        **summarize(
            rec,
            status,
            workload.arrival,
            workload.prompt_len,
            result.duration_s,
            memory.capacity_tokens,
        ),  # fmt: skip
        "num_compiles": result.num_compiles,
        "compiles_after_warmup": result.compiles_after_warmup,
        "compile_cache_hits": result.cache_hits,
        "compile_cache": str(cache_dir(cfg.engine.compile_cache) or "off"),
        "warmup_s": result.warmup_s,
        "warmup_shapes": result.warmup_shapes,
        "warmup_planned": result.warmup_planned,
        "wall_s": result.wall_s,
        "resumed_from": cfg.resume or None,
    }
    if cfg.engine.loop == "device" and cfg.engine.clock == "measured":
        # Timed as a whole: latencies in passes are its exact clock.
        in_passes = summarize(
            rec.in_passes(), status, workload.arrival, workload.prompt_len, rec.num_passes,
            memory.capacity_tokens,
        )  # fmt: skip
        metrics["mean_pass_s"] = result.wall_s / max(rec.num_passes, 1)
        latencies = ("ttft", "tpot", "itl", "e2e")
        metrics["in_passes"] = {k: in_passes[f"{k}_s"] for k in latencies}
    if cfg.workload.kind == "task" and result.outputs is not None:
        done = np.flatnonzero(status == FINISHED)
        right = [tasks.is_correct(workload.tokens[i], result.outputs[i]) for i in done]
        metrics["task_accuracy"] = float(np.mean(right)) if right else None
    out_dir.mkdir(parents=True, exist_ok=True)
    ran_on = provenance(cfg.policy.module)
    (out_dir / "provenance.json").write_text(json.dumps(ran_on, indent=2) + "\n")
    (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    metrics["config"], metrics["provenance"] = "config.yaml", ran_on
    files.write_metrics(out_dir / "metrics.json", metrics)
    files.write_requests(
        out_dir / "requests.csv", workload.ids, workload.arrival, workload.prompt_len,
        workload.max_new, status, np.asarray(final.num_preemptions),
        request_times(rec, len(workload)), rejections(cfg, workload, memory),
    )  # fmt: skip
    files.write_passes(out_dir / "passes.csv", rec, memory.block_size if memory.paged else 0)
    write_trace(out_dir / "trace.json", rec, workload.prompt_len, cfg.engine.clock)
    files.save_record(out_dir / "record.npz", rec)
    if cfg.output.tokens and result.outputs is not None:
        files.write_tokens(out_dir / "tokens.jsonl", result.outputs, tokenizer(cfg.model.path))
    if cfg.output.plots:
        plot_timeline(rec, out_dir / "timeline.png", f"{cfg.policy.name}: {rec.num_passes} passes")
        plot_memory(rec, memory.capacity_tokens, out_dir / "memory.png", memory.layout)
    return metrics


def summary_table(metrics: dict) -> str:
    """The console summary. With the passes clock every time is a count of passes (arrivals too)
    and throughput is per pass; with the measured clock times are seconds (latencies in ms)."""
    passes = metrics["clock"] == "passes"
    duration = f"{metrics['duration_s']:.0f} passes" if passes else f"{metrics['duration_s']:.3f} s"
    per = "pass" if passes else "s"
    rows = [
        ("policy", metrics["policy"]),
        ("requests finished / rejected",
         f"{metrics['num_finished']} / {metrics['num_rejected']} of {metrics['num_requests']}"),
        ("passes", metrics["num_passes"]),
        ("duration", f"{duration} ({metrics['clock']} clock, {metrics['loop']} loop)"),
        ("output throughput", f"{metrics['output_throughput_tok_s']:.{3 if passes else 1}f} "
         f"tok/{per}"),
        ("TTFT p50 / p99", _pair(metrics["ttft_s"], passes)),
        ("TPOT p50 / p99", _pair(metrics["tpot_s"], passes)),
        ("slot utilisation", f"{metrics['slot_utilization']:.1%}"),
        ("padding waste", f"{metrics['padding_waste']:.1%}"),
        ("KV memory", f"{metrics['memory_layout']}, {metrics['kv_budget_tokens']} positions, "
         f"peak {metrics['kv_peak_utilization']:.1%}, waste {metrics['kv_mean_waste']:.1%}"),
        ("preemptions", metrics["num_preemptions"]),
        ("compiles (after warm-up)",
         f"{metrics['num_compiles']} ({metrics['compiles_after_warmup']}), "
         f"{metrics['compile_cache_hits']} loaded from the compile cache"),
        ("warm-up", f"{metrics['warmup_s']:.2f} s, {metrics['warmup_shapes']} pass shapes"
         + (" (a dry run's)" if metrics["warmup_planned"] else "")),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _pair(s: dict, passes: bool) -> str:
    if s["p50"] is None:
        return "-"
    if passes:
        return f"{s['p50']:.1f} / {s['p99']:.1f} passes"
    return f"{s['p50'] * 1e3:.2f} / {s['p99'] * 1e3:.2f} ms"


INTERRUPT = Interrupt()  # Ctrl-C: the run stops between passes and writes what it did
# Results of sweep jobs already run as one program, by job number (hydra.job.num): the vmap
# launcher (hydra_plugins/jaxbatch_launcher) fills it before it runs each job's `main`.
DONE: dict[int, RunResult] = {}


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    """One run, or one job of a sweep. Bad input: one message and exit code 2 (in a sweep, the
    job's error.json, and the sweep goes on). Ctrl-C: the outputs of the passes done, one line
    saying so, and exit code 130 (in a sweep, after the summary of the jobs so far)."""
    config: Config = OmegaConf.to_object(cfg)
    hydra_cfg = HydraConfig.get()
    out_dir = Path(hydra_cfg.runtime.output_dir)
    sweep_dir = Path(hydra_cfg.sweep.dir) if hydra_cfg.mode == RunMode.MULTIRUN else None
    INTERRUPT.catch()
    if INTERRUPT() and sweep_dir:  # Ctrl-C between two jobs: run no more
        _stop_sweep(sweep_dir)
    try:
        done = DONE.pop(hydra_cfg.job.num, None) if sweep_dir else None
        metrics = execute(
            config, out_dir, Path(hydra.utils.get_original_cwd()), INTERRUPT, result=done
        )
    except (ConfigError, WorkloadError) as err:
        print(f"jaxbatch: error: {err}", file=sys.stderr)
        if sweep_dir is None:
            sys.exit(2)
        files.write_error(out_dir / "error.json", err)
        return
    except Exception as err:
        if sweep_dir is None:
            raise
        traceback.print_exc()  # one failing job must not end the sweep: it is recorded
        files.write_error(out_dir / "error.json", err)
        return
    print(summary_table(metrics))
    print(f"  outputs in {out_dir}")
    if metrics["interrupted"]:
        unfinished = metrics["num_requests"] - metrics["num_finished"] - metrics["num_rejected"]
        saved = resume.latest_step(out_dir / "checkpoint")
        if saved is not None:
            print(f"jaxbatch: checkpoint of pass {saved} in {out_dir / 'checkpoint'}; continue "
                  f"the run with: jaxbatch resume={out_dir}", file=sys.stderr)  # fmt: skip
        print(
            f"jaxbatch: interrupted after {metrics['num_passes']} passes: {unfinished} requests "
            f"left unfinished (status interrupted); outputs in {out_dir}",
            file=sys.stderr,
        )
        if sweep_dir:
            _stop_sweep(sweep_dir)
        sys.exit(130)


def _stop_sweep(sweep_dir: Path) -> None:
    rows, _ = summarize_sweep(sweep_dir)
    print(
        f"jaxbatch: sweep interrupted: {len(rows)} runs summarised in {sweep_dir}/summary.csv",
        file=sys.stderr,
    )
    sys.exit(130)
