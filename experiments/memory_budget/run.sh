#!/usr/bin/env bash
# Throughput and TPOT against the KV budget, for contiguous (max_len, exact) and paged memory,
# on the Azure conversation trace and on a synthetic mix. 16 slots: the budget decides.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here/../.."
common="memory=contiguous,contiguous_exact,paged memory.budget_mib=4,8,16 engine.num_slots=16 output.progress=false"
jaxbatch -m workload=azure_conv workload.limit=60 $common hydra.sweep.dir="$here/runs/trace"
jaxbatch -m workload=synthetic_mixed workload.num_requests=60 $common hydra.sweep.dir="$here/runs/synthetic"
python "$here/plot.py" "$here/runs/trace" "$here/runs/synthetic" --out "$here/memory_budget.png"
