"""Simulated passes per second: the host loop, the device loop, and sweeps of `--members` runs (over
arrival rates, and over workload seeds) as one vmapped device loop against the same runs one after
another (the target: 10x). A sweep runs its members in `sweep_loop.sweep_groups` groups, one
host thread each (on this CPU, one per core); it is also timed as one group, for comparison.
Continuous batching on `--slots` slots, `--requests` Poisson requests (prompts 16..512, outputs
16..256) per run, Llama-3 8B priced on one H100. The three ways of running a sweep are timed in
`--repeats` interleaved rounds; each figure is their median. Compilation is excluded from every
figure and printed apart. The loops' times exclude building the results from their records, as
both ways do after their clocks stop; the whole calls less their warm-up, which include it, are
printed too, and the ratio of the fastest rounds (the machine's noise only slows a round: a run
whose rounds one by one ran slow once read 11.6x where the sweep had not changed). Asserts
nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
from common import config, median
from omegaconf import OmegaConf

from jaxbatch.calibrate import HARDWARE_DIR
from jaxbatch.config import HardwareConfig, LengthConfig, ModelConfig
from jaxbatch.device_loop import run_device
from jaxbatch.run import build_backend, memory_spec, simulate
from jaxbatch.sched.policies import PolicyParams, make_policy
from jaxbatch.sched.state import init_state
from jaxbatch.sweep_loop import run_sweep, sweep_groups
from jaxbatch.workload import from_config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--members", type=int, default=64)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cfg = config("continuous", args.slots, args.requests,
                 LengthConfig(dist="uniform", low=16, high=512),
                 LengthConfig(dist="uniform", low=16, high=256), "tiny")  # fmt: skip
    cfg.model = ModelConfig(**OmegaConf.to_container(OmegaConf.load(
        HARDWARE_DIR.parent / "model" / "llama3_8b.yaml")))  # fmt: skip
    cfg.hardware = HardwareConfig(**OmegaConf.to_container(OmegaConf.load(
        HARDWARE_DIR / "h100_sxm.yaml")))  # fmt: skip
    cfg.engine = dataclasses.replace(cfg.engine, backend="simulator", clock="priced")
    cfg.workload.arrival, cfg.workload.rate = "poisson", 20.0
    workload = from_config(cfg.workload)
    for loop in ("host", "device"):
        run_cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, loop=loop))
        simulate(run_cfg, workload)  # compiles
        t0 = time.perf_counter()
        res = simulate(run_cfg, workload)
        seconds = time.perf_counter() - t0
        print(f"{loop:>6} loop, one run: {res.record.num_passes} passes in {seconds:.2f} s "
              f"({res.record.num_passes / seconds:,.0f} passes/s, compile excluded: "
              f"{res.warmup_s:.1f} s apart)")  # fmt: skip
    # Two sweeps, each run one by one (`run_device`, as `simulate` runs them) and as one program
    # (`run_sweep`): over arrival rates (the same requests, arrivals stretched from 0.25x to 4x:
    # members of very different lengths) and over workload seeds (members of about one length).
    memory = memory_spec(cfg)
    backend = build_backend(cfg, workload, memory)
    policy, params = make_policy("continuous"), PolicyParams()

    def state(w, scale=1.0):
        return init_state(w.arrival * scale, w.prompt_len, w.max_new, np.zeros(len(w), bool),
                          args.slots, memory=memory)  # fmt: skip

    seeds = [from_config(dataclasses.replace(cfg.workload, seed=s)) for s in range(args.members)]
    sweeps = {
        "arrival rates 0.25x..4x": [state(workload, s) for s in np.geomspace(0.25, 4.0, args.members)],
        "workload seeds": [state(w) for w in seeds],
    }  # fmt: skip
    groups = sweep_groups(args.members)
    for name, states in sweeps.items():
        fed = max(int(np.asarray(st.prompt_len).sum() + np.asarray(st.max_new).sum())
                  for st in states) + 16  # fmt: skip
        seconds = {"alone": [], "groups": [], "one": [], "alone whole": [], "groups whole": [],
                   "groups warm-up": []}  # fmt: skip
        for _ in range(args.repeats):  # interleaved rounds: the machine's drift hits all three
            t0 = time.perf_counter()
            alone = [run_device(policy, params, st, backend, fed) for st in states]
            t1 = time.perf_counter()
            together = run_sweep(policy, [params] * args.members, states,
                                 [backend] * args.members, fed, groups)  # fmt: skip
            t2 = time.perf_counter()
            one = run_sweep(policy, [params] * args.members, states, [backend] * args.members,
                            fed, 1)  # fmt: skip
            seconds["alone"].append(sum(r.wall_s for r in alone))
            seconds["groups"].append(together[0].wall_s)
            seconds["one"].append(one[0].wall_s)
            # whole calls less their warm-up: the loops and the results built from their records
            seconds["alone whole"].append(t1 - t0 - sum(r.warmup_s for r in alone))
            seconds["groups whole"].append(t2 - t1 - together[0].warmup_s)
            seconds["groups warm-up"].append(together[0].warmup_s)
        counts = [r.record.num_passes for r in alone]
        passes = sum(counts)
        assert passes == sum(r.record.num_passes for r in together)
        sequential, vmapped, single, whole_seq, whole_vm = (
            median(seconds[k]) for k in ("alone", "groups", "one", "alone whole", "groups whole")
        )
        compile_s = sum(r.warmup_s for r in alone)
        print(f"{args.members} members over {name}, {passes} passes in all (the longest member "
              f"{max(counts) / np.mean(counts):.2f}x the mean: a group's members step together "
              f"until its longest ends), medians of {args.repeats}: one by one {sequential:.2f} s "
              f"({passes / sequential:,.0f} passes/s; compiles {compile_s:.1f} s apart), vmapped "
              f"in {groups} group(s) {vmapped:.2f} s ({passes / vmapped:,.0f} passes/s; compile "
              f"{seconds['groups warm-up'][0]:.1f} s apart, then "
              f"{median(seconds['groups warm-up'][1:] or [0.0]):.2f} s with the programs kept "
              f"in the process): {sequential / vmapped:.1f}x; as one group "
              f"{single:.2f} s: {sequential / single:.1f}x; with the results built from the "
              f"records (whole calls less their warm-up): one by one {whole_seq:.2f} s, vmapped "
              f"{whole_vm:.2f} s: {whole_seq / whole_vm:.1f}x; fastest rounds (this VM's noise "
              f"only slows a round, and a slow round of the runs one by one inflates the "
              f"ratio): one by one {min(seconds['alone']):.2f} s, vmapped "
              f"{min(seconds['groups']):.2f} s: "
              f"{min(seconds['alone']) / min(seconds['groups']):.1f}x")  # fmt: skip


if __name__ == "__main__":
    main()
