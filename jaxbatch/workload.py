"""Request generation: synthetic arrival processes and length distributions, and trace replay.

A Workload is plain numpy arrays, one entry per request, plus each request's seeded prompt token
ids. Bad input raises WorkloadError naming the field (or the trace file and line); nothing here
touches JAX.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

from jaxbatch import tasks

# Lengths are held as int64 and capped here: a trace count beyond any model (20 digits, say) is kept
# as this cap, which every model's max_len rejects, instead of overflowing.
LENGTH_CAP = 2**40


class WorkloadError(ValueError):
    """A workload that cannot be built: the message names the field or the file and line."""


@dataclass(frozen=True)
class Workload:
    arrival: np.ndarray  # [N] float64 seconds from the first request
    prompt_len: np.ndarray  # [N] int64
    max_new: np.ndarray  # [N] int64 output budget
    priority: np.ndarray = field(default=None)  # [N] int64, 0 when unset
    seed: int = 0
    ids: np.ndarray = field(default=None)  # [N] identity: seeds the prompt and the sampling
    tokens: tuple | None = None  # each prompt's token ids (text and task workloads); else seeded

    def __post_init__(self):
        n = len(self.arrival)
        if self.priority is None:
            object.__setattr__(self, "priority", np.zeros(n, np.int64))
        if self.ids is None:
            object.__setattr__(self, "ids", np.arange(n))

    def subset(self, index) -> Workload:
        """The chosen requests, each keeping its identity (same prompt, same sampling stream)."""
        pick = lambda a: np.asarray(a)[index]  # noqa: E731
        return Workload(
            arrival=pick(self.arrival), prompt_len=pick(self.prompt_len),
            max_new=pick(self.max_new), priority=pick(self.priority), seed=self.seed,
            ids=pick(self.ids),
            tokens=None if self.tokens is None else tuple(
                self.tokens[i] for i in np.arange(len(self))[index]
            ),
        )  # fmt: skip

    def __len__(self) -> int:
        return len(self.arrival)

    def prompts(self, vocab_size: int, width: int) -> np.ndarray:
        """[N, width] int32: a request's prompt (its text's tokens; else seeded: it depends only
        on (seed, its id)), zero after it."""
        out = np.zeros((len(self), width), np.int32)
        for i, (rid, n) in enumerate(zip(self.ids, self.prompt_len)):
            n = int(min(n, width))
            if self.tokens is not None:
                out[i, :n] = self.tokens[i][:n]
            else:
                out[i, :n] = np.random.default_rng([self.seed, int(rid)]).integers(0, vocab_size, n)
        return out

    def rejections(self, max_len: int) -> list[str]:
        """Per request, why it can never run on a model of this maximum length ('' if it can)."""
        reasons = []
        for p, m in zip(self.prompt_len.tolist(), self.max_new.tolist()):
            if p < 1 or m < 1:
                reasons.append(f"prompt_len {p} and max_new_tokens {m} must both be >= 1")
            elif p + m > max_len:
                reasons.append(
                    f"prompt_len {_count(p)} + max_new_tokens {_count(m)} > model max_len {max_len}"
                )
            else:
                reasons.append("")
        return reasons


def _count(n: int) -> str:
    return f">= {LENGTH_CAP}" if n >= LENGTH_CAP else str(n)


def lengths(dist: str, mean: float, low: int, high: int, sigma: float, n: int, rng) -> np.ndarray:
    """n lengths: `fixed` (mean), `uniform` [low, high] or `lognormal` (mean, sigma, clipped)."""
    if dist == "fixed":
        return np.full(n, int(mean), np.int64)
    if dist == "uniform":
        return rng.integers(low, high + 1, n).astype(np.int64)
    if dist == "lognormal":
        x = rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, n)
        return np.clip(np.round(x), low, high).astype(np.int64)
    raise WorkloadError(f"length dist={dist!r} is not valid: use fixed, uniform or lognormal")


def arrivals(process: str, n: int, rate: float, burstiness: float, rng) -> np.ndarray:
    """Arrival times: `offline` (all at 0), `poisson` at `rate`/s, or `gamma` inter-arrivals with
    shape `burstiness` and mean 1/rate (vLLM's definition: 1 is Poisson, below 1 is burstier)."""
    if process == "offline":
        return np.zeros(n)
    if process == "poisson":
        gaps = rng.exponential(1.0 / rate, n)
    elif process == "gamma":
        gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), n)
    else:
        raise WorkloadError(f"arrival={process!r} is not valid: use offline, poisson or gamma")
    gaps[0] = 0.0
    return np.cumsum(gaps)


def read_trace(
    path: str | Path,
    limit: int = 0,
    time_scale: float = 1.0,
    length_scale: float = 1.0,
    output_scale: float = 0.0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Azure-schema CSV (TIMESTAMP, ContextTokens, GeneratedTokens) -> arrival, prompt, output.

    Arrivals are seconds after the first row, times time_scale; lengths are scaled by
    length_scale (outputs by output_scale when it is not 0) and kept at least 1. `limit` > 0 keeps
    the first `limit` rows.
    """
    path = Path(path)
    if not path.is_file():
        raise WorkloadError(f"workload.path={str(path)!r}: no such trace file")
    times, prompt, output = [], [], []
    with path.open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        expected = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
        if header is None:
            raise WorkloadError(f"{path}: the file is empty: a trace starts with the header "
                                f"{','.join(expected)}")  # fmt: skip
        if [h.strip() for h in header[:3]] != expected:
            raise WorkloadError(f"{path}:1: header {header} is not {expected}")
        for line, row in enumerate(reader, start=2):
            if limit and len(times) >= limit:
                break
            times.append(_parse_time(row, path, line))
            prompt.append(_parse_count(row, 1, "ContextTokens", path, line))
            output.append(_parse_count(row, 2, "GeneratedTokens", path, line))
    if not times:
        raise WorkloadError(f"{path}: the trace has no request rows")
    t = np.array(times)
    arrival = (t - t[0]) * time_scale
    if np.any(np.diff(arrival) < 0):
        line = int(np.argmax(np.diff(arrival) < 0)) + 3
        raise WorkloadError(f"{path}:{line}: TIMESTAMP goes back in time")

    def scale(counts, k):
        return np.clip(np.round(np.array(counts, np.float64) * k), 1, LENGTH_CAP).astype(np.int64)

    return arrival, scale(prompt, length_scale), scale(output, output_scale or length_scale)


def _parse_time(row: list[str], path: Path, line: int) -> float:
    if len(row) != 3:
        raise WorkloadError(f"{path}:{line}: expected 3 fields, found {len(row)}: {row}")
    text = row[0].strip()
    try:
        stamp, _, frac = text.partition(".")
        base = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S").timestamp()
        return base + (float("0." + frac) if frac else 0.0)
    except ValueError:
        raise WorkloadError(
            f"{path}:{line}: TIMESTAMP {text!r} is not 'YYYY-MM-DD HH:MM:SS[.fffffff]'"
        ) from None


def _parse_count(row: list[str], col: int, name: str, path: Path, line: int) -> int:
    text = row[col].strip()
    if not text.isdigit():
        raise WorkloadError(f"{path}:{line}: {name} {text!r} is not a non-negative integer")
    return min(int(text), LENGTH_CAP)


def tokenizer(model_path: str):
    """The `tokenizers` Tokenizer of a model directory's tokenizer.json (None: there is none)."""
    file = Path(model_path).expanduser() / "tokenizer.json" if model_path else None
    if file is None or not file.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(file))


def read_text(path: Path, tok) -> Workload:
    """A JSONL file of {"prompt": text, "max_new_tokens": n[, "arrival": seconds]}, one request
    a line, its prompt tokenised by `tok`."""
    if not path.is_file():
        raise WorkloadError(f"workload.path={str(path)!r}: no such file")
    arrival, tokens, budget = [], [], []
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{line_no}"
        try:
            row = json.loads(line)
            text, n = row["prompt"], int(row["max_new_tokens"])
            arrival.append(float(row.get("arrival", 0.0)))
        except (ValueError, KeyError, TypeError) as err:
            raise WorkloadError(f"{where}: each line is a JSON object with a string 'prompt' "
                                f"and an integer 'max_new_tokens' ({err!r})") from None  # fmt: skip
        if not isinstance(text, str):
            raise WorkloadError(f"{where}: 'prompt' must be a string")
        if n < 1:
            raise WorkloadError(f"{where}: 'max_new_tokens' must be >= 1, not {n}")
        if not (math.isfinite(arrival[-1]) and arrival[-1] >= 0):  # NaN would never arrive
            raise WorkloadError(f"{where}: 'arrival' must be a finite number of seconds >= 0, "
                                f"not {arrival[-1]!r}")  # fmt: skip
        tokens.append(np.asarray(tok.encode(text).ids, np.int64))
        budget.append(n)
    if not tokens:
        raise WorkloadError(f"workload.path={str(path)!r}: no requests in it")
    return Workload(
        arrival=np.asarray(arrival), prompt_len=np.array([len(t) for t in tokens]),
        max_new=np.asarray(budget, np.int64), tokens=tuple(tokens),
    )  # fmt: skip


def from_config(cfg, base_dir: Path | None = None, model_path: str = "") -> Workload:
    """Build the workload of a WorkloadConfig; a relative trace or text path is taken from
    base_dir; a text workload is tokenised by `model_path`'s tokenizer.json."""
    path = Path(cfg.path)
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if cfg.kind == "text":
        tok = tokenizer(model_path)
        if tok is None:
            raise WorkloadError("workload.kind='text' needs model=hf with a tokenizer.json in "
                                f"model.path ({model_path!r} has none)")  # fmt: skip
        return read_text(path, tok)
    if cfg.kind == "trace":
        arrival, prompt, output = read_trace(
            path, cfg.limit, cfg.time_scale, cfg.length_scale, cfg.output_scale
        )
        return Workload(arrival=arrival, prompt_len=prompt, max_new=output, seed=cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    n = cfg.num_requests
    arrival = arrivals(cfg.arrival, n, cfg.rate, cfg.burstiness, rng)
    if cfg.kind == "task":  # the model's EOS ends each answer; the budget leaves room past it
        prompts, _ = tasks.sample(rng, n, cfg.max_digits, tuple(tasks.TASKS))
        return Workload(
            arrival=arrival, prompt_len=np.array([len(x) for x in prompts]),
            max_new=np.full(n, cfg.max_digits + 4), tokens=tuple(prompts), seed=cfg.seed,
        )  # fmt: skip
    p, o = cfg.prompt, cfg.output
    prompt = lengths(p.dist, p.mean, p.low, p.high, p.sigma, n, rng)
    output = lengths(o.dist, o.mean, o.low, o.high, o.sigma, n, rng)
    priority = rng.integers(0, cfg.priority_levels, n)
    return Workload(
        arrival=arrival, prompt_len=prompt, max_new=output, priority=priority, seed=cfg.seed
    )
