"""Fit the cost model's constants by timing the real engine on this machine.

Runs the real `Engine` (default model unless told otherwise) through prefill-heavy and
decode-heavy batches, records for every step the features the cost model uses — computed tokens,
KV tokens read, scheduled sequences — and the wall time of `Engine.step()`, and fits
`t = c0 + c_tok*new + c_kv*kv + c_seq*seqs` by non-negative least squares. The features are the
scheduler's own output (`StepShape.of`), noted by wrapping the engine's scheduler (`_watch`: the
engine has no hook for the lab). Each run is repeated and
every step keeps its fastest time: other processes on a shared machine only ever add time, so
the minimum is the least disturbed measurement.
"""
from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from batchgen_lab.sim.costmodel import CostModel

# (prompt length, batch size, output tokens): prefills of growing length, then decode batches
PREFILL_RUNS = [(128, 1, 1), (512, 1, 1), (1024, 1, 1), (256, 4, 1)]
DECODE_RUNS = [(32, 1, 8), (32, 16, 8), (256, 1, 8), (256, 16, 8), (512, 8, 8)]


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients: refit without the columns that go negative."""
    keep = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while keep:
        sol, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if (sol >= 0).all():
            coef[keep] = sol
            break
        keep = [k for k, s in zip(keep, sol) if s >= 0]
    return coef


Run = tuple[int, int, int]


def measure(model: str | None = None, seed: int = 0, repeats: int = 3,
            runs: Sequence[Run] | None = None, device: str = "cpu",
            **engine_kwargs: Any) -> tuple[list[tuple], int, int]:
    """(new_tokens, kv_tokens, num_seqs, seconds) for every step of the calibration runs, plus
    the engine's KV bytes per token and KV capacity in tokens. `engine_kwargs` override the
    engine's calibration shape (64 seats, 2048 batched tokens)."""
    from batchgen_data.engine.engine import Engine
    from batchgen_data.sampling_params import SamplingParams

    engine = Engine.from_kwargs(model, device=device, **{
        "max_num_seqs": 64, "max_num_batched_tokens": 2048, **engine_kwargs})
    feats = _watch(engine)
    vocab = min(engine.vocab_size, 20000)
    best: dict[tuple[int, int], tuple] = {}  # (run, step) -> fastest (features..., seconds)
    for rep in range(repeats + 1):  # repetition 0 warms up
        rng = random.Random(seed)  # same prompts every repetition: same steps
        engine.reset_prefix_cache()
        for run, (plen, batch, out_len) in enumerate(runs or PREFILL_RUNS + DECODE_RUNS):
            params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
            plen = min(plen, engine.max_model_len - out_len - 1)  # tiny test models are short
            for _ in range(batch):
                engine.submit([rng.randrange(100, vocab) for _ in range(plen)], params)
            step = 0
            while engine.has_unfinished():
                t0 = time.perf_counter()
                engine.step()
                dt = time.perf_counter() - t0
                if rep and feats[-1][2] > 0:
                    row = (*feats[-1], dt)
                    if (run, step) not in best or dt < best[(run, step)][3]:
                        best[(run, step)] = row
                step += 1
    load = engine.load()
    return (list(best.values()), load.kv_bytes_per_token,
            load.total_blocks * load.block_size)


def _watch(engine: Any) -> list[tuple[int, int, int]]:
    """(new tokens, KV tokens, sequences) of every step `engine` schedules from now on, empty
    ones too: its scheduler's `schedule` wrapped on this instance."""
    from batchgen_data.engine.stats import StepShape

    feats: list[tuple[int, int, int]] = []
    schedule = engine.scheduler.schedule

    def noted() -> Any:
        out = schedule()
        st = StepShape.of(out)
        feats.append((st.num_new_tokens, st.kv_tokens, st.num_seqs))
        return out

    engine.scheduler.schedule = noted
    return feats


def fit(rows: list[tuple], base: CostModel, name: str, source: str) -> CostModel:
    data = np.array(rows, dtype=float)
    x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1], data[:, 2]])
    c0, c_tok, c_kv, c_seq = _nnls(x, data[:, 3])
    return replace(base, name=name, c0=float(c0), c_tok=float(c_tok), c_kv=float(c_kv),
                   c_seq=float(c_seq), source=source)


def calibrate(model: str | None = None, repeats: int = 3, runs: Sequence[Run] | None = None,
              device: str = "cpu", name: str | None = None, pcie_bytes_per_s: float = 10e9,
              link_bytes_per_s: float = 1.25e9, **engine_kwargs: Any) -> tuple[CostModel, dict]:
    """Measure and fit; returns the model and fit diagnostics (steps, relative error).
    On a GPU the step time is measured around `Engine.step()`, which waits for the sampled
    tokens on the host, so every timed step includes its kernels. The two transfer rates are
    not measured here (host-device and network bandwidth for moving KV): pass the machine's."""
    rows, bytes_per_token, capacity = measure(model, repeats=repeats, runs=runs, device=device,
                                              **engine_kwargs)
    kind = device.split(":")[0]
    name = name or f"{kind}-calibrated"
    base = CostModel(name, 0.0, 0.0, 0.0, 0.0, bytes_per_token=bytes_per_token,
                     kv_capacity_tokens=capacity, pcie_bytes_per_s=pcie_bytes_per_s,
                     link_bytes_per_s=link_bytes_per_s)
    when = time.strftime("%Y-%m-%d")
    cm = fit(rows, base, name, f"calibrate on {when}: {len(rows)} timed steps of "
                               f"{model or 'the default model'} ({device})")
    pred = np.array([cm.step_time(a, b, c) for a, b, c, _ in rows])
    real = np.array([r[3] for r in rows])
    diag = {"steps": len(rows), "median_rel_error": float(np.median(np.abs(pred - real) / real)),
            "total_time_ratio": float(pred.sum() / real.sum())}
    return cm, diag
