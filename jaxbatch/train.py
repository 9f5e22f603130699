"""`jaxbatch-train`: train a model on the digit tasks (tasks.py) with optax, and save it with orbax.

AdamW with a linear warm-up then cosine decay of the learning rate, gradients clipped by global
norm; the loss is the cross-entropy of the answer tokens (EOS included) under teacher forcing.
Held-out examples (another seed) give the held-out loss and answer accuracy: the share of answers
whose every token, EOS included, is the model's argmax, which is what greedy decoding of that
prompt returns. A progress bar shows the loss; every `--log-every` steps a line goes to the
terminal and to `train_log.jsonl`. The checkpoint (`model.checkpoint=DIR`) loads into
`model=tiny_trained`.

    jaxbatch-train --out checkpoints/tiny_trained         # the tiny model: 665 s measured here
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from jaxbatch import tasks
from jaxbatch.config import model_preset
from jaxbatch.model.checkpoint import save_trained
from jaxbatch.model.spec import ModelSpec
from jaxbatch.model.transformer import full_forward, init_params


def _scores(spec: ModelSpec, params, tokens, scored):
    """Per example: summed answer cross-entropy, answer tokens, and whether all are the argmax."""
    logits = full_forward(spec, params, tokens)[:, :-1]
    target, mask = tokens[:, 1:], scored[:, :-1]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, target)
    right = (logits.argmax(-1) == target) | ~mask
    return (ce * mask).sum(1), mask.sum(1), right.all(1)


def loss_fn(params, spec: ModelSpec, tokens, scored):
    ce, n, _ = _scores(spec, params, tokens, scored)
    return ce.sum() / n.sum()


@partial(jax.jit, static_argnums=(0, 1))
def train_step(spec: ModelSpec, optimizer, params, opt_state, tokens, scored):
    loss, grads = jax.value_and_grad(loss_fn)(params, spec, tokens, scored)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


@partial(jax.jit, static_argnums=0)
def evaluate(spec: ModelSpec, params, tokens, scored) -> tuple[jax.Array, jax.Array]:
    """Held-out (loss per answer token, answer accuracy)."""
    ce, n, right = _scores(spec, params, tokens, scored)
    return ce.sum() / n.sum(), right.mean()


def optimizer_for(steps: int, lr: float, warmup: int, clip: float, weight_decay: float):
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, end_value=lr / 100)
    return optax.chain(
        optax.clip_by_global_norm(clip), optax.adamw(schedule, weight_decay=weight_decay)
    )


def train(
    spec: ModelSpec, steps: int, batch_size: int = 64, max_digits: int = 12,
    task_names: tuple[str, ...] = tuple(tasks.TASKS), lr: float = 1e-3, warmup: int = 100,
    clip: float = 1.0, weight_decay: float = 0.01, seed: int = 0, held_out: int = 512,
    log_every: int = 100, progress: bool = True, log=None,
) -> tuple[dict, list[dict]]:  # fmt: skip
    """Train from `init_params(spec, seed)`; returns the parameters and the log (one entry before
    training, one per `log_every` steps and one at the end: step, the step's training loss,
    held-out loss and answer accuracy)."""
    length = 2 * max_digits + 4  # BOS task digits SEP answer EOS
    rng = np.random.default_rng(seed)
    eval_batch = tasks.batch(*tasks.sample(np.random.default_rng(seed + 1), held_out, max_digits,
                                           task_names), length)  # fmt: skip
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), init_params(spec, seed))
    optimizer = optimizer_for(steps, lr, min(warmup, steps // 2), clip, weight_decay)
    opt_state = optimizer.init(params)
    history, t0 = [], time.perf_counter()
    bar = tqdm(range(steps + 1), disable=not progress, desc="train", unit="step")
    loss = None
    for step in bar:
        if step:
            batch = tasks.batch(*tasks.sample(rng, batch_size, max_digits, task_names), length)
            params, opt_state, loss = train_step(spec, optimizer, params, opt_state, *batch)
        if step % log_every == 0 or step == steps:
            held_loss, accuracy = evaluate(spec, params, *eval_batch)
            entry = dict(step=step, loss=float(loss) if step else None,
                         held_out_loss=float(held_loss),
                         held_out_accuracy=float(accuracy),
                         elapsed_s=round(time.perf_counter() - t0, 1))  # fmt: skip
            history.append(entry)
            bar.set_postfix(loss=f"{float(held_loss):.3f}", acc=f"{float(accuracy):.1%}")
            if log:
                log(entry)
    return params, history


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="jaxbatch-train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--out", type=Path, required=True, help="the checkpoint directory to write")
    ap.add_argument("--model", default="tiny", help="a config of configs/model/ (random init)")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-digits", type=int, default=12)
    ap.add_argument("--tasks", default=",".join(tasks.TASKS))
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=100)
    args = ap.parse_args(argv)
    task_names = tuple(args.tasks.split(","))
    unknown = [t for t in task_names if t not in tasks.TASKS]
    if unknown:
        ap.error(f"--tasks: {', '.join(unknown)} is not a task; use {', '.join(tasks.TASKS)}")
    spec = model_preset(args.model).spec()
    args.out.mkdir(parents=True, exist_ok=True)
    log_file = (args.out / "train_log.jsonl").open("w")

    def log(entry: dict) -> None:
        tqdm.write(json.dumps(entry))
        log_file.write(json.dumps(entry) + "\n")
        log_file.flush()

    params, history = train(
        spec, args.steps, args.batch, args.max_digits, task_names, args.lr, args.warmup,
        seed=args.seed, log_every=args.log_every, log=log,
    )  # fmt: skip
    info = dict(trained_from=args.model, tasks=list(task_names), max_digits=args.max_digits,
                steps=args.steps, batch=args.batch, final=history[-1])  # fmt: skip
    save_trained(args.out, params, spec, info)
    print(f"jaxbatch-train: held-out answer accuracy {history[-1]['held_out_accuracy']:.1%} "
          f"after {args.steps} steps; checkpoint in {args.out}: "
          f"jaxbatch model=tiny_trained model.checkpoint={args.out}")  # fmt: skip


if __name__ == "__main__":
    main()
