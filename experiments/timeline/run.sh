#!/usr/bin/env bash
# The seed figure: one queue of 32 requests through static and continuous batching on 8 slots.
set -euo pipefail
cd "$(dirname "$0")"
out=$(mktemp -d)
jaxbatch -m policy=static,continuous output.progress=false hydra.sweep.dir="$out"
cp "$out/timelines.png" timeline.png
cp "$out/summary.csv" summary.csv
python ../../benchmarks/static_vs_continuous.py --repeats 3
