#!/usr/bin/env bash
# Decode stalls: continuous (prefill-first), orca (whole prompts in mixed passes) and chunked
# prefill at several token budgets, on the Azure code trace (long prompts, short outputs).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here/../.."
trace="workload=azure_code workload.limit=80 workload.time_scale=0.1 workload.length_scale=0.1 workload.output_scale=1.0"
common="engine.num_slots=16 output.progress=false"
jaxbatch -m policy=continuous,orca policy.token_budget=1024 $trace $common hydra.sweep.dir="$here/runs/baselines"
jaxbatch -m policy=chunked policy.token_budget=64,128,256 $trace $common hydra.sweep.dir="$here/runs/chunked"
python "$here/plot.py" "$here/runs/baselines" "$here/runs/chunked" --out "$here/chunked_prefill.png"
