#!/usr/bin/env bash
# A policy of one's own (policy.py: `capped`) against continuous (cap 0) and chunked prefill,
# simulated for Llama-3 8B on one H100 (priced clock: the same figures on any machine).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here/../.."
# the caps as one vmapped program (a traced knob); chunked on the same workload as the contrast
jaxbatch -m +experiment=admission_cap hydra/launcher=vmap hydra.sweep.dir="$here/runs/capped"
jaxbatch -m +experiment=admission_cap policy.name=chunked policy.max_partial_prefills=0 \
  policy.token_budget=512,2048 hydra.sweep.dir="$here/runs/chunked"
python "$here/report.py" "$here/runs/capped" "$here/runs/chunked" | tee "$here/results.txt"
