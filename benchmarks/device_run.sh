#!/usr/bin/env bash
# One short accelerator run, for a GPU or TPU machine: installs the accelerator build of JAX (the
# version already installed, so jaxlib and its plugin match), then, on a random-init 1B-class
# model in bfloat16 (configs/model/llama3_2_1b.yaml; MODEL=... for another config):
#   1. kernel_check.py: the fused attention kernel of the platform (cuDNN on a GPU, Pallas on a
#      TPU) against the portable path, logits and tokens;
#   2. throughput.py: output tokens/s of every policy on one workload (prompts and outputs uniform
#      in 16..512), side by side in one process;
#   3. a memory-budget sweep (paged KV, continuous batching) through the jaxbatch CLI, with its
#      per-run metrics.json and summary.csv.
# Everything goes to one folder (first argument; default device_run/<date>-<time>), each step's
# output in its own .txt. Each step has a time limit, so the whole run stays within 8 minutes.
# On a machine with no accelerator it runs the same steps on the CPU (set MODEL=tiny there).
#
#   bash benchmarks/device_run.sh [OUT]      # from the repository root, after `pip install -e .`
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-device_run/$(date +%Y%m%d-%H%M%S)}
MODEL=${MODEL:-llama3_2_1b}
REQUESTS=${REQUESTS:-256}
SLOTS=${SLOTS:-64}
BUDGETS_MIB=${BUDGETS_MIB:-512,1024,2048}
mkdir -p "$OUT"
log() { echo "device_run: $*" | tee -a "$OUT/steps.txt"; }

# 0. The accelerator build of JAX, when the machine has an accelerator JAX does not see yet.
backend() { python -c 'import jax; print(jax.default_backend())' 2>/dev/null; }
version=$(python -c 'import jax; print(jax.__version__)')
if [ "$(backend)" = cpu ]; then
  if command -v nvidia-smi >/dev/null; then
    log "installing jax[cuda12]==$version"
    pip install -q "jax[cuda12]==$version" || log "install failed: running on $(backend)"
  elif ls /dev/accel* /dev/vfio >/dev/null 2>&1; then
    log "installing jax[tpu]==$version"
    pip install -q "jax[tpu]==$version" || log "install failed: running on $(backend)"
  fi
fi
(cd / && python -c 'import jaxbatch') 2>/dev/null || pip install -q -e .
{
  python -c 'import jax; print("jax", jax.__version__, jax.default_backend(), jax.devices())'
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv
  git rev-parse HEAD
} > "$OUT/device.txt" 2>&1
log "$(head -1 "$OUT/device.txt"); model $MODEL, $REQUESTS requests, $SLOTS slots"

step() {  # name, time limit (s), command...
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  log "$name: exit $rc after $((SECONDS - start)) s ($OUT/$name.txt)"
  tail -n 8 "$OUT/$name.txt"
}

# 1. The platform's fused attention kernel against the portable path.
step kernel_check 120 python benchmarks/kernel_check.py --model "$MODEL"
# 2. Every policy's throughput on one workload, one process.
step throughput 200 python benchmarks/throughput.py --model "$MODEL" --repeats 1 \
  --requests "$REQUESTS" --slots "$SLOTS" --lengths 16 512 --budget 512
# 3. A memory-budget sweep through the CLI: continuous batching over paged KV.
step budget_sweep 150 jaxbatch -m model="$MODEL" memory=paged memory.budget_mib="$BUDGETS_MIB" \
  engine.num_slots="$SLOTS" workload.num_requests="$REQUESTS" \
  workload.prompt.dist=uniform workload.prompt.low=16 workload.prompt.high=512 \
  workload.output.dist=uniform workload.output.low=16 workload.output.high=512 \
  output.plots=false output.progress=false hydra.sweep.dir="$OUT/budget_sweep"
log "done in $SECONDS s: $OUT"
