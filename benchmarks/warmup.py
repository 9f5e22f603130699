"""Warm-up of a first and of repeated runs of one config, each in a new process, sharing one
compile cache (empty at the start): what a sweep's jobs or a rerun of a command pay before their
clock starts. Prints each run's warm-up, the pass shapes it prepared (`p`: a dry run's, see the
README's Compilation), compilations and compile-cache hits, and the repeated runs' median against
issue 11's target (under 2 s).

    python benchmarks/warmup.py [--repeats 2] [--only "device loop"]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["output.plots=false", "output.progress=false", "model.n_kv_heads=4"]
REALISTIC = [
    "engine.num_slots=16", "workload.num_requests=64", "workload.prompt.dist=uniform",
    "workload.prompt.low=16", "workload.prompt.high=128", "workload.output.dist=uniform",
    "workload.output.low=16", "workload.output.high=128",
]  # fmt: skip
CONFIGS = {
    "default (8 slots, 32-token prompts)": [],
    "realistic, continuous": [*REALISTIC, "policy=continuous"],
    "realistic, chunked": [*REALISTIC, "policy=chunked"],
    # the runner's device loop (not the default): one program holding every pass, loaded whole
    "realistic, continuous, device loop": [*REALISTIC, "policy=continuous", "engine.loop=device"],
    "realistic, chunked, device loop": [*REALISTIC, "policy=chunked", "engine.loop=device"],
}


def run(overrides: list[str], cache: Path, out: Path) -> dict:
    cmd = [sys.executable, "-m", "jaxbatch", *QUIET, *overrides,
           f"engine.compile_cache={cache}", f"hydra.run.dir={out}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(proc.stderr[-2000:])
    return json.loads((out / "metrics.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2, help="repeated runs after the first")
    ap.add_argument("--only", default="", help="the configs whose name holds this text")
    args = ap.parse_args()
    print(f"{'config':36s} {'run':>6s} {'warm-up s':>10s} {'shapes':>7s} {'compiles':>9s} "
          f"{'loaded':>7s}")  # fmt: skip
    for name, overrides in CONFIGS.items():
        if args.only not in name:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            cache, repeated = Path(tmp) / "cache", []
            for i in range(1 + args.repeats):
                m = run(overrides, cache, Path(tmp) / f"run{i}")
                label = "first" if i == 0 else f"rep {i}"
                shapes = f"{m['warmup_shapes']}{'p' if m['warmup_planned'] else ''}"
                print(f"{name:36s} {label:>6s} {m['warmup_s']:10.2f} {shapes:>7s} "
                      f"{m['num_compiles']:9d} {m['compile_cache_hits']:7d}")  # fmt: skip
                if i:
                    repeated.append(m["warmup_s"])
            med = statistics.median(repeated)
            verdict = "reached" if med < 2.0 else "not reached"
            print(f"{name:36s} repeated median {med:.2f} s; target under 2 s: {verdict}")


if __name__ == "__main__":
    main()
