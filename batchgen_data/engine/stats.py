"""Counters an engine keeps about itself (cheap to update on every step), and the shape of one
step (what the lab's cost model is fitted on, lab/batchgen_lab/sim/calibrate.py)."""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from batchgen_data.core.scheduler import SchedulerOutput

_COMPUTED = attrgetter("num_computed_tokens")


@dataclass
class ExpertLoad:
    """How many tokens each expert received per step (MoE models): the expert batch sizes that
    expert-level batching is about. For each step and MoE layer: the mean over its experts, and
    its least and most loaded expert; `summary()` averages them over layers and steps (the unit
    of HF's per-router-call figures in benchmarks/moe_throughput.py)."""

    layer_steps: int = 0  # (step, MoE layer) pairs recorded
    mean_sum: float = 0.0
    min_sum: int = 0
    max_sum: int = 0
    # expert parallel: the ranks whose contiguous slices of the experts split the work (0: none)
    ranks: int = 0
    rank_sums: list[int] = field(default_factory=list)  # [ranks] (token, expert) pairs each

    def record(self, counts: torch.Tensor) -> None:
        """One step's counts [moe_layers, experts]; an empty tensor (dense model) is skipped."""
        if counts.numel() == 0:
            return
        self.layer_steps += counts.shape[0]
        self.mean_sum += counts.float().mean(dim=1).sum().item()
        self.min_sum += int(counts.min(dim=1).values.sum())
        self.max_sum += int(counts.max(dim=1).values.sum())
        if self.ranks > 1 and counts.shape[1] % self.ranks == 0:
            # rank r holds experts [r E / ranks, (r + 1) E / ranks)
            per = counts.sum(0).view(self.ranks, -1).sum(1).tolist()
            self.rank_sums = [a + int(b) for a, b in
                              zip(self.rank_sums or [0] * self.ranks, per)]

    def summary(self) -> dict[str, Any] | None:
        """{"mean", "min", "max"} tokens per expert per step and layer, and "layer_steps";
        with expert parallelism also "per_rank": the (token, expert) pairs routed to each rank's
        slice of the experts per step and layer (its share of the expert work); None before
        any MoE step."""
        if not self.layer_steps:
            return None
        n = self.layer_steps
        out: dict[str, Any] = {"mean": self.mean_sum / n, "min": self.min_sum / n,
                               "max": self.max_sum / n, "layer_steps": n}
        if self.rank_sums:
            out["per_rank"] = [total / n for total in self.rank_sums]
        return out


class DecodeSpeed:
    """An engine's device speed, read from its pure decode steps whatever their load.

    The fastest light step alone (`EngineStats.min_decode_step_s`) mixes device and load: a
    fast engine whose lightest steps carried long contexts reads slower than a straggler whose
    lightest steps were short (so their floors can differ by less than the shedding threshold
    though one device is much slower, and a long row stays on the straggler). A decode step's
    time is close to linear in its sequences and the KV it reads (weights once per step, KV
    per token, a little per sequence), so this fits `dt = a + b * seqs + c * kv_tokens` by
    least squares over the last `window` pure decode steps and reports the fitted time of one
    reference step (`REF_SEQS` sequences, `REF_KV` tokens of context): on two engines of one
    model it differs only by their speed, whatever KV their measured steps carried. Until the
    steps seen span enough shapes to fit the three terms (`MIN_STEPS`, and a full-rank
    design), `step_s()` is 0.0 and the caller keeps the floor.
    """

    REF_SEQS = 1
    REF_KV = 0
    MIN_STEPS = 8

    def __init__(self, window: int = 256) -> None:
        self.samples: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._fit: float | None = None  # cached result, None: stale

    def record(self, num_seqs: int, kv_tokens: int, dt: float) -> None:
        self.samples.append((num_seqs, kv_tokens, dt))
        self._fit = None

    def step_s(self) -> float:
        if self._fit is None:
            self._fit = self._solve()
        return self._fit

    def _solve(self) -> float:
        import numpy as np

        if len(self.samples) < self.MIN_STEPS:
            return 0.0
        data = np.asarray(self.samples, dtype=np.float64)
        # columns scaled to about 1, so the rank test reads shapes, not units
        scale = np.maximum(np.abs(data[:, :2]).max(axis=0), 1.0)
        x = np.column_stack([np.ones(len(data)), data[:, 0] / scale[0], data[:, 1] / scale[1]])
        coef, _res, rank, sing = np.linalg.lstsq(x, data[:, 2], rcond=None)
        if rank < 3 or sing[-1] < 1e-6 * sing[0]:
            return 0.0  # every step had the same shape (or seqs and KV moved together)
        ref = np.array([1.0, self.REF_SEQS / scale[0], self.REF_KV / scale[1]])
        got = float(ref @ coef)
        # a reference step is lighter than any measured one; a fit that says otherwise (noise
        # on a few steps) is not trusted
        return got if 0.0 < got <= float(data[:, 2].min()) else 0.0


@dataclass
class EngineStats:
    num_steps: int = 0
    max_batch_seqs: int = 0
    # sequences per step -> steps
    batch_seqs_hist: Counter[int] = field(default_factory=Counter)
    computed_tokens: int = 0  # tokens run through the model (prompts, decodes, recomputes)
    generated_tokens: int = 0
    num_preemptions: int = 0  # running sequences the scheduler held for memory
    num_finished: int = 0
    num_failed: int = 0  # requests a step failed for alone (engine/step_failure.py)
    step_time_s: float = 0.0
    # seconds per token of prompt-heavy steps (>= 4 tokens per sequence), moving average: what
    # recomputing a moved sequence's KV would cost here (0.0 until such a step ran)
    prefill_s_per_token: float = 0.0
    # seconds of the fastest pure decode step (one token per sequence) with at most half the
    # seats busy, 0.0 before one: the engine's speed at light load, which placement compares to
    # spot a straggler (a full engine's steps are slower for its load, not its device)
    min_decode_step_s: float = 0.0
    # the device speed fitted from pure decode steps of any load (`DecodeSpeed`), what the
    # load report gives placement (`decode_step_s()`); `as_dict` has its reference step time
    decode_speed: DecodeSpeed = field(default_factory=DecodeSpeed)
    # MoE models: tokens per expert per step (`ExpertLoad.summary()` in `as_dict`)
    tokens_per_expert: ExpertLoad = field(default_factory=ExpertLoad)
    # cpu_offload_gb > 0: weight bytes streamed host -> device, and the peak weight bytes
    # resident on the device (resident weights + the layers in the streaming workspace)
    offload_bytes_moved: int = 0
    offload_peak_resident_bytes: int = 0
    # host_kv_tier_bytes > 0: KV bytes moved between the host tier and the device, and the
    # most sequences with KV in the host tier that one step ran (docs/offload.md)
    kv_host_bytes_moved: int = 0
    kv_host_seqs_peak: int = 0
    # async_scheduling: steps scheduled and prepared while the step before ran (docs/step.md)
    overlapped_steps: int = 0

    def record(self, num_seqs: int, num_tokens: int, num_sampled: int, dt: float,
               light_seqs: int = 0, kv_tokens: int | None = None) -> None:
        """One step's counts; a pure decode step of at most `light_seqs` sequences (0: any)
        counts towards `min_decode_step_s`, and any pure decode step with its `kv_tokens`
        (context attended over) towards `decode_speed`."""
        if kv_tokens is not None and 0 < num_seqs == num_tokens:
            self.decode_speed.record(num_seqs, kv_tokens, dt)
        if num_tokens >= 4 * num_seqs and num_tokens >= 32:
            rate = dt / num_tokens
            self.prefill_s_per_token = rate if not self.prefill_s_per_token else (
                0.8 * self.prefill_s_per_token + 0.2 * rate)
        if 0 < num_seqs == num_tokens and (not light_seqs or num_seqs <= light_seqs) and (
                not self.min_decode_step_s or dt < self.min_decode_step_s):
            self.min_decode_step_s = dt
        self.num_steps += 1
        self.max_batch_seqs = max(self.max_batch_seqs, num_seqs)
        self.batch_seqs_hist[num_seqs] += 1
        self.computed_tokens += num_tokens
        self.generated_tokens += num_sampled
        self.step_time_s += dt

    def decode_step_s(self) -> float:
        """The engine's speed as placement reads it (`EngineLoad.decode_step_s`): the fitted
        reference step (`DecodeSpeed`) once the steps seen allow a fit, the fastest light
        decode step before that (0.0: none yet)."""
        return self.decode_speed.step_s() or self.min_decode_step_s

    def as_dict(self) -> dict[str, Any]:
        speed = self.decode_speed
        self.decode_speed = None  # type: ignore[assignment]  # asdict would copy its samples
        try:
            d = asdict(self)
        finally:
            self.decode_speed = speed
        d["decode_speed"] = {"step_s": speed.step_s(), "steps": len(speed.samples)}
        d["batch_seqs_hist"] = dict(self.batch_seqs_hist)
        d["tokens_per_expert"] = self.tokens_per_expert.summary()
        return d


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one scheduled step asks of the model (its context feeds the speed fit)."""

    num_seqs: int
    num_new_tokens: int  # tokens computed in the step (prompt chunks, decodes, recomputes)
    kv_tokens: int  # context attended over: each sequence's computed + new tokens, summed

    @classmethod
    def of(cls, out: SchedulerOutput) -> StepShape:
        total = out.total_tokens
        known = out.arrays  # the running sequences' computed tokens, read by the scheduler
        k = 0 if known is None else len(known[0])
        computed = sum(map(_COMPUTED, out.seqs[k:])) + (0 if known is None else int(known[0].sum()))
        return cls(len(out.seqs), total, computed + total)
