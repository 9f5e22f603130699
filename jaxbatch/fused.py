"""The fused loop: a whole offline run (schedule, mixed pass, commit, recording) as one
`jax.lax.while_loop` on the device, with no host round trip per pass.

A pass with prompt tokens runs the runner's mixed pass (the token budget's rows), one without the
all-slot decode; `lax.switch` picks the compiled branch of the pass's context bucket, so the loop
reads no more context than the host loop. Only the token-budget policies (orca, chunked) fit.
The clock inside counts passes; the host times the whole loop.

The loop runs in segments of a bounded number of passes (about SEGMENT_S seconds each): between
two, the host advances the progress bar and reads `stop()`, so Ctrl-C ends a run within a segment.
Results come back once, at the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxbatch.backend.compilation import cache_hits, num_compiles
from jaxbatch.backend.runner import (
    PassOut,
    Runner,
    _forward,
    decode_rows,
    flatten,
    store_tokens,
)
from jaxbatch.engine import RunResult, kv_live, kv_reserved
from jaxbatch.interrupt import never
from jaxbatch.report.recorder import Record, emitted
from jaxbatch.sched.policies import Policy, PolicyParams
from jaxbatch.sched.state import FINISHED, MIXED, REJECTED, SchedState

SEGMENT_S = 0.25  # the fused loop's segments last about this long (a first one: 8 passes)


def _pad_rows(x, width: int):
    """Pad a per-row array to `width` rows: padding rows are invalid (False, 0) or out of range."""
    pad = [(0, width - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
    return jnp.pad(x, pad, constant_values=jnp.iinfo(jnp.int32).max if x.dtype == jnp.int32 else 0)


def run_fused(
    policy: Policy,
    params: PolicyParams,
    state: SchedState,
    runner: Runner,
    max_passes: int,
    clock: str = "measured",
    progress: bool = False,
    stop: Callable[[], bool] = never,
) -> RunResult:
    """Run every request of an offline workload (all arrived at 0) to the end in one compiled
    loop, or until `stop()` says to (read between segments). With the measured clock, pass p
    starts at p x the loop's mean pass time; with the passes clock at p. Compilation and one run
    of every branch count as warm-up; `compiles_after_warmup` counts any compilation during the
    run."""
    b = state.num_slots
    rows = runner.buckets.mixed_rows
    longest = int(np.max(np.asarray(state.prompt_len + state.max_new)))
    contexts = sorted({runner.buckets.decode(n).context for n in range(1, longest + 1)})
    width = max(rows, b)  # every branch's rows, padded to one shape for lax.switch

    def body(weights, warm, carry):
        st, cache, buf, p, rec = carry
        st, plan = policy.schedule(st.replace(now=p.astype(jnp.float32)), params)
        common = dict(
            spec=runner.spec, sampling=runner.sampling, num_slots=b, with_logits=False, write=False
        )
        args = (weights, cache, buf, runner.prompt_len, runner.request_ids)

        flat = flatten(plan, rows, b)

        def mixed(context):  # prompt tokens in the pass: the token budget's flattened rows
            def run():
                return _padded(
                    _forward(
                        *args,
                        *flat,
                        shape=runner.buckets.flat(rows, context, any_plan=True),
                        **common,
                    )
                )

            return run

        def decode(shape):  # no prompt tokens: the cheaper all-slot decode
            def run():
                return _padded(_forward(*args, *decode_rows(plan, shape), shape=shape, **common))

            return run

        def _padded(forward) -> PassOut:  # each slot's token is [b] in every branch
            _, out = forward
            # The write after the switch needs only where rows go, not how attention tiled them.
            index = out.index.replace(slots=out.index.row_slots, tiles=0, tile=0, num_slots=0)
            rows_of = out.replace(index=index, tokens=None)
            return jax.tree.map(partial(_pad_rows, width=width), rows_of).replace(tokens=out.tokens)

        # One branch per pass kind and context bucket, as the host loop's buckets: the pass reads
        # only as much context as its longest row needs. The branches only read the cache; it is
        # written once below, in place (a branch that wrote it would make XLA copy the cache).
        max_end = jnp.max(jnp.where(plan.num_tokens > 0, plan.start_pos + plan.num_tokens, 0))
        bucket = jnp.searchsorted(jnp.array(contexts), max_end, side="left")
        branch = jnp.where(plan.kind == MIXED, bucket, len(contexts) + bucket)
        branches = [mixed(c) for c in contexts]
        branches += [decode(runner.buckets.decode(c)) for c in contexts]
        branch = jnp.where(warm, p, branch)  # warm-up: pass p runs branch p
        out = jax.lax.switch(branch, branches)
        cache, buf = cache.write(out.ks, out.vs, out.index), store_tokens(buf, out)
        holder = st.slot_req
        st = policy.commit(st, plan, out.tokens, params)
        kv, granted = kv_live(st, holder), kv_reserved(st)
        rec = {
            "req": rec["req"].at[p].set(plan.req), "num_tokens": rec["num_tokens"].at[p].set(
                plan.num_tokens), "start_pos": rec["start_pos"].at[p].set(plan.start_pos),
            "holder": rec["holder"].at[p].set(holder), "kv": rec["kv"].at[p].set(kv),
            "granted": rec["granted"].at[p].set(granted), "kind": rec["kind"].at[p].set(plan.kind),
        }  # fmt: skip
        return st, cache, buf, p + 1, rec

    num_branches = 2 * len(contexts)

    def loop(weights, st, cache, buf, p, rec, warm, end):  # weights as an argument, not constants
        """Passes p.. until every request ends, max_passes, or pass `end` (a segment's end)."""

        def cond(carry):
            st, _, _, p, _ = carry
            live = (st.status != FINISHED) & (st.status != REJECTED)
            return jnp.where(warm, p < num_branches, live.any() & (p < max_passes) & (p < end))

        return jax.lax.while_loop(cond, partial(body, weights, warm), (st, cache, buf, p, rec))

    grid = np.full((max_passes, b), -1, np.int32)
    zeros = np.zeros(max_passes, np.int32)
    rec = {"req": grid, "num_tokens": grid * 0, "start_pos": grid * 0, "holder": grid,
           "kv": zeros, "granted": zeros, "kind": zeros}  # fmt: skip
    rec = jax.tree.map(jnp.asarray, rec)
    compiles0, hits0, t0 = num_compiles(), cache_hits(), time.perf_counter()
    start = jnp.int32(0)
    compiled = jax.jit(loop, donate_argnums=(2, 3, 5)).lower(
        runner.params, state, runner.cache, runner.token_buf, start, rec, True, start
    )
    compiled = compiled.compile()
    # Warm-up, as the host loop runs each compiled pass once: XLA's first run of each branch costs
    # far more than later ones (a whole 38-pass run: 0.55 s the first time, 0.26 s the next). It
    # runs branch p at pass p on a copy of the token buffer. The K/V it leaves in the cache sit at
    # stale positions, which no pass reads (each reads only what its slot's request has written).
    # Its record rows are overwritten by the run's passes.
    warm_buf = runner.token_buf.copy()
    _, runner.cache, _, _, rec = compiled(
        runner.params, state, runner.cache, warm_buf, start, rec, True, start
    )
    jax.block_until_ready(runner.cache)
    compile_s = time.perf_counter() - t0
    compiles_warm, t0 = num_compiles(), time.perf_counter()
    st, p, length = state, 0, 8
    bar = tqdm(
        total=int(np.asarray(state.max_new)[np.asarray(state.status) != REJECTED].sum()),
        disable=not progress, unit="tok", desc=policy.name, leave=False,
    )  # fmt: skip
    while not stop():
        t_segment = time.perf_counter()
        end = min(p + length, max_passes)
        st, runner.cache, runner.token_buf, p_next, rec = compiled(
            runner.params, st, runner.cache, runner.token_buf, jnp.int32(p), rec, False,
            jnp.int32(end),
        )  # fmt: skip
        p_next = int(p_next)  # waits for the segment
        if progress:
            bar.n = int(np.asarray(st.num_generated).sum())
            bar.refresh()
        seconds = time.perf_counter() - t_segment
        length = int(np.clip(SEGMENT_S * (p_next - p) / max(seconds, 1e-6), 8, 1 << 16))
        done, p = p_next < end, p_next
        if done or p == max_passes:
            break
    wall_s = time.perf_counter() - t0
    bar.close()
    final, rec, interrupted = jax.device_get((st, rec)) + (stop(),)
    unfinished = ((final.status != FINISHED) & (final.status != REJECTED)).any()
    if p == max_passes and unfinished and not interrupted:
        raise RuntimeError(f"the fused loop did not end within max_passes={max_passes}")
    req, num_tokens, start_pos = rec["req"][:p], rec["num_tokens"][:p], rec["start_pos"][:p]
    emits = emitted(req, num_tokens, start_pos, np.asarray(final.prompt_len))
    kind = rec["kind"][:p]
    unit = wall_s / max(p, 1) if clock == "measured" else 1.0  # seconds (or passes) per pass
    record = Record(
        start=np.arange(p) * unit, duration=np.full(p, unit), kind=kind, req=req,
        num_tokens=num_tokens, start_pos=start_pos, holder=rec["holder"][:p], emits=emits,
        computed_tokens=np.where(kind == MIXED, rows, b), kv_tokens=rec["kv"][:p],
        kv_reserved=rec["granted"][:p],
    )  # fmt: skip
    return RunResult(
        record=record,
        final=final,
        outputs=runner.outputs(np.asarray(final.num_generated)),
        logits=None,
        duration_s=p * unit,
        warmup_s=compile_s,
        num_compiles=num_compiles() - compiles0,
        compiles_after_warmup=num_compiles() - compiles_warm,
        cache_hits=cache_hits() - hits0,
        wall_s=wall_s,
        interrupted=bool(interrupted and unfinished),
    )
