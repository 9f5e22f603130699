"""The simulator priced for this machine (`hardware=cpu_local`, fitted by `jaxbatch-calibrate`)
against real runs of the same configs, side by side: output throughput and p50 TPOT per policy, and
their ratios (the target: within 15%). The tiny model, 64 offline requests with prompts and outputs
uniform in 16..128, 16 slots; orca and chunked take 512 tokens a pass. Real figures are medians of
`--repeats` runs, the policies interleaved (one policy's runs back to back once read static above
continuous in a slow moment, 2026-12-07). It first reads the machine as calibration does (`calibrate.machine`) and prints
that beside the entry's figures: a rough gauge of how far this shared VM's speed has moved since
the calibration (once on 2026-12-06 it read 1.10x the entry's while the real runs were slower
than just after the calibration). Asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from common import config, median
from omegaconf import OmegaConf

from jaxbatch.calibrate import HARDWARE_DIR, machine
from jaxbatch.config import HardwareConfig, LengthConfig
from jaxbatch.report.metrics import summarize
from jaxbatch.run import memory_spec, simulate
from jaxbatch.workload import from_config


def figures(cfg, workload) -> tuple[float, float]:
    """(output tok/s, p50 TPOT s) of one run."""
    res = simulate(cfg, workload)
    m = summarize(res.record, res.final.status, workload.arrival, workload.prompt_len,
                  res.duration_s, memory_spec(cfg).capacity_tokens)  # fmt: skip
    return m["output_throughput_tok_s"], m["tpot_s"]["p50"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--policies", default="static,continuous,orca,chunked")
    ap.add_argument(
        "--entry",
        type=Path,
        default=HARDWARE_DIR / "cpu_local.yaml",
        help="the hardware entry to simulate on (jaxbatch-calibrate --out writes one)",
    )
    args = ap.parse_args()
    lengths = LengthConfig(dist="uniform", low=16, high=128)
    entry = OmegaConf.to_container(OmegaConf.load(args.entry))
    hardware = HardwareConfig(**entry)
    print(f"{args.entry.stem}: compute efficiency {hardware.compute_efficiency}, memory efficiency "
          f"{hardware.memory_efficiency}, attention efficiency {hardware.attention_efficiency}, "
          f"overlap {hardware.overlap}, padded {hardware.padded}, overhead "
          f"{hardware.pass_overhead_us} us (prefill "
          f"{hardware.prefill_overhead_us:+} us, mixed {hardware.mixed_overhead_us:+} us)")  # fmt: skip
    bandwidth, peak = machine()
    print(f"machine now: read {bandwidth / 1e9:.1f} GB/s, matmul {peak / 1e9:.0f} GFLOP/s "
          f"(the entry: {hardware.memory_gb_s:.1f} GB/s, {1e3 * hardware.peak_tflops:.0f} GFLOP/s; "
          f"now / then {bandwidth / 1e9 / hardware.memory_gb_s:.2f} and "
          f"{peak / 1e12 / hardware.peak_tflops:.2f})")  # fmt: skip
    print(f"{'policy':>11} {'real tok/s':>11} {'sim tok/s':>10} {'ratio':>6}   "
          f"{'real TPOT ms':>12} {'sim TPOT ms':>11} {'ratio':>6}")  # fmt: skip
    policies = args.policies.split(",")
    cfgs = {}
    for policy in policies:
        cfgs[policy] = config(policy, 16, 64, lengths, lengths, "tiny")
        cfgs[policy].policy.token_budget = 512
    workload = from_config(cfgs[policies[0]].workload)  # the same requests for every policy
    real = {policy: [] for policy in policies}
    for _ in range(args.repeats):  # interleaved, so a slow moment of this VM hits every policy
        for policy in policies:
            real[policy].append(figures(cfgs[policy], workload))
    for policy in policies:
        cfg = cfgs[policy]
        tok, tpot = median([r[0] for r in real[policy]]), median([r[1] for r in real[policy]])
        sim_cfg = dataclasses.replace(
            cfg, hardware=hardware,
            engine=dataclasses.replace(cfg.engine, backend="simulator", clock="priced"),
            # the real run's KV budget, not what cpu_local's memory would hold
            memory=dataclasses.replace(cfg.memory, budget_tokens=memory_spec(cfg).budget_tokens),
        )  # fmt: skip
        sim_tok, sim_tpot = figures(sim_cfg, workload)
        print(f"{policy:>11} {tok:11.1f} {sim_tok:10.1f} {sim_tok / tok:6.2f}   "
              f"{1e3 * tpot:12.2f} {1e3 * sim_tpot:11.2f} {sim_tpot / tpot:6.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
