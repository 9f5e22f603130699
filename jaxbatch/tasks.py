"""Digit tasks whose answers are checkable and end where the prompt says: the corpus that
`jaxbatch-train` trains on, and the prompts of `workload.kind=task`.

A prompt is `BOS task d1 .. dn SEP` and its answer the task applied to the digits, then EOS:
`copy` repeats them, `reverse` reverses them, `sort` sorts them. n is uniform in 1..max_digits, so
an answer's length (n + 1 with its EOS) depends on its prompt and a model trained on these ends
its answers by itself. Token ids are below 32: every model's vocabulary holds them.
"""

from __future__ import annotations

import numpy as np

PAD, BOS, EOS, SEP = 0, 1, 2, 3
TASKS = {"copy": 4, "reverse": 5, "sort": 6}
DIGIT0 = 10  # digits 0..9 are ids 10..19


def answer(task: str, digits: np.ndarray) -> np.ndarray:
    """The answer's digit ids (no EOS)."""
    if task == "copy":
        return digits
    if task == "reverse":
        return digits[::-1]
    return np.sort(digits)


def sample(rng: np.random.Generator, n: int, max_digits: int, tasks: tuple[str, ...]):
    """n examples: (prompts, answers), each a list of int32 arrays; answers end with EOS."""
    prompts, answers = [], []
    for _ in range(n):
        task = tasks[rng.integers(len(tasks))]
        digits = DIGIT0 + rng.integers(0, 10, rng.integers(1, max_digits + 1))
        prompts.append(np.array([BOS, TASKS[task], *digits, SEP], np.int32))
        answers.append(np.array([*answer(task, digits), EOS], np.int32))
    return prompts, answers


def batch(prompts: list[np.ndarray], answers: list[np.ndarray], length: int):
    """Teacher-forcing arrays [n, length]: tokens (prompt, answer, PAD), and a mask of the
    positions whose next token is an answer token (the loss and accuracy positions)."""
    tokens = np.full((len(prompts), length), PAD, np.int32)
    scored = np.zeros((len(prompts), length), bool)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        seq = np.concatenate([p, a])
        tokens[i, : len(seq)] = seq
        scored[i, len(p) - 1 : len(seq) - 1] = True
    return tokens, scored


def is_correct(prompt: np.ndarray, output: np.ndarray) -> bool:
    """Whether an output (generated ids, EOS included when the model emitted it) is the
    prompt's answer followed by EOS."""
    task = {v: k for k, v in TASKS.items()}[int(prompt[1])]
    want = answer(task, prompt[2:-1])
    return len(output) == len(want) + 1 and bool((output[:-1] == want).all()) and output[-1] == EOS
