#!/usr/bin/env bash
# A model that ends its own answers: train the tiny model on the digit tasks (unless a checkpoint
# is there), then serve 128 task prompts under every policy and both memory layouts.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here/../.."
[ -f checkpoints/tiny_trained/model.json ] || jaxbatch-train --out checkpoints/tiny_trained
cp checkpoints/tiny_trained/train_log.jsonl "$here/train_log.jsonl"
# The full training's stated result: at least 95% of held-out answers exactly right.
python - "$here/train_log.jsonl" <<'PY'
import json, sys
last = [json.loads(line) for line in open(sys.argv[1])][-1]
accuracy = last["held_out_accuracy"]
print(f"held-out answer accuracy at step {last['step']}: {accuracy:.1%} (stated: at least 95%)")
sys.exit(0 if accuracy >= 0.95 else "trained_model: the training fell short of 95%")
PY
jaxbatch -m +experiment=trained_model hydra.sweep.dir="$here/runs"
cp "$here/runs/by_policy.png" "$here/by_policy.png"
python - "$here/runs" > "$here/results.txt" <<'PY'
import csv, sys
from pathlib import Path
runs = Path(sys.argv[1])
print(f"{'overrides':<40}{'task accuracy':>14}{'output tok/s':>14}{'mean output':>13}{'passes':>8}")
accuracies = set()
for row in csv.DictReader((runs / "summary.csv").open()):
    accuracies.add(row["task_accuracy"])
    job = runs / row["job"]
    outs = [int(r["output_len"]) for r in csv.DictReader((job / "requests.csv").open())]
    print(f"{row['overrides']:<40}{float(row['task_accuracy']):>14.1%}"
          f"{float(row['output_throughput_tok_s']):>14.1f}{sum(outs) / len(outs):>13.2f}"
          f"{row['num_passes']:>8}")
if len(accuracies) != 1:
    sys.exit(f"trained_model: task accuracy depends on the policy: {sorted(accuracies)}")
PY
cat "$here/results.txt"
