"""Step-time cost model that stands in for the model runner in the cluster simulator.

One engine step that computes `new` tokens for `n` sequences attending over `kv` KV tokens costs

    linear  (default):        t = c0 + c_mem + c_tok*new + c_kv*kv + c_seq*n
    overlap (overlap=True):   t = c0 + c_seq*n + max(c_tok*new, c_mem + c_kv*kv)

c0 is the per-step floor (launches, scheduling); c_mem the time to stream the weights once;
c_tok the matmul time of one token; c_kv the time to read one token's KV; c_seq per-sequence
work (sampling, bookkeeping). The linear form charges decode tokens their full matmul time on
top of the memory traffic, which overstates a big decode batch's cost on a GPU (where compute
hides under memory until the batch is large): it is the conservative choice for a comparison
that rewards full batches, and the presets use it. `overlap` is the roofline form; with it,
batching admissions changes step times, so coarse runs (`EngineShape.max_finishes` > 1) are
biased: use `--max-finishes 1` with it. Attention FLOPs of long prefills (quadratic in the
prompt) are not modelled: for 8B at an 8k context they add about a quarter to a prefill token.

Presets (bf16; derived from public spec sheets and typical vLLM figures, not measured here):

* `h200-llama8b` (default for the headline numbers): Llama-3.1-8B on one H200 (4.8 TB/s HBM3e,
  989 TFLOP/s dense bf16). c_mem = 16.1 GB of weights at 80% of peak bandwidth = 4.2 ms, c0 =
  1.5 ms, so one stream decodes at ~173 tok/s, in line with published single-request numbers.
  c_tok = 2 x 8.0 GFLOP at 55% MFU = 29.5 us (prefill ~34k tok/s). c_kv = 128 KiB/token at 80%
  of peak = 34 ns. c_seq = 5 us. KV capacity ~107 GB = 800k tokens. 256 sequences then decode
  at ~11k tok/s at a 1k context and ~6.9k tok/s at 2.6k. PCIe Gen5 50 GB/s, network 25 GB/s
  per GPU. Engine defaults 1024 seats / 16384 batched tokens (see below).
* `a100-qwen0.5b`: Qwen2.5-0.5B on one A100-80GB (2.0 TB/s, 312 TFLOP/s): c_mem = 1 GB at 80%
  = 0.6 ms, c0 = 2.4 ms (small models are overhead-bound), c_tok = 2 x 0.49 GFLOP at 40% MFU =
  7.9 us, c_kv = 12 KiB at 80% = 7.7 ns, c_seq = 5 us; KV capacity 5.5M tokens. PCIe Gen4
  25 GB/s, network 12.5 GB/s. Engine defaults 256 seats / 8192 batched tokens.
* `cpu-smollm2`: SmolLM2-135M fp32 on the 2-core development VM, linear form, measured by
  `python -m batchgen_lab.sim calibrate` (c0 = 71.5 ms is mostly streaming 540 MB of fp32
  weights; prefill ~520 tok/s); `--out f.json` writes a refit that `--preset f.json` uses.
  Engine 256 seats / 16384 batched tokens (the simulator's earlier default, kept).

Each preset also carries the engine shape vLLM would pick by default on its device
(`max_num_seqs`, `max_num_batched_tokens`; `EngineShape.for_cost` reads them, the command
line's `--max-num-seqs` / `--max-num-batched-tokens` override them). Source:
vllm/engine/arg_utils.py, `EngineArgs.get_batch_defaults`: for the offline `LLM` class
(`UsageContext.LLM_CLASS`), a device with >= 70 GiB whose name does not contain "a100" (H100,
H200, MI300x) gets max_num_seqs 1024 and max_num_batched_tokens 16384; any other GPU (A100
included, because a larger token budget cost it throughput, vLLM PR #17885) gets 256 / 8192.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from batchgen_data.placement import TransferCost


@dataclass(frozen=True, slots=True)
class CostModel:
    name: str
    c0: float  # seconds per step that nothing overlaps
    c_tok: float  # seconds per computed token
    c_kv: float  # seconds per KV token read
    c_seq: float  # seconds per scheduled sequence
    bytes_per_token: int  # KV bytes of one token (all layers, K and V)
    kv_capacity_tokens: int  # KV tokens that fit on one device
    pcie_bytes_per_s: float
    link_bytes_per_s: float
    c_mem: float = 0.0  # seconds to stream the weights once per step
    overlap: bool = False  # GPU: compute hides under memory traffic (or the reverse)
    source: str = ""
    # the engine shape vLLM defaults to on this device (module docstring); EngineShape.for_cost
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name not in ("name", "source", "overlap") and (
                    not isinstance(v, (int, float)) or v < 0):
                raise ValueError(f"CostModel.{f.name}={v!r}: must be a number >= 0")
        for name in ("kv_capacity_tokens", "bytes_per_token", "max_num_seqs",
                     "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"CostModel.{name} must be >= 1")

    def step_time(self, new_tokens: int, kv_tokens: int, num_seqs: int) -> float:
        comp = self.c_tok * new_tokens
        mem = self.c_mem + self.c_kv * kv_tokens
        fixed = self.c0 + self.c_seq * num_seqs
        return fixed + (max(comp, mem) if self.overlap else comp + mem)

    def decode_steps_time(self, n: int, kv_first: int, a: int, b: int) -> float:
        """Total time of steps a..b (1-based) of a run where n sequences decode one token each
        and read `kv_first + (j - 1) * n` KV tokens at step j: the sum of `step_time` in closed
        form (an arithmetic series, split where memory overtakes compute)."""
        if b < a:
            return 0.0
        fixed = self.c0 + (self.c_tok + self.c_seq) * n if not self.overlap else (
            self.c0 + self.c_seq * n)
        mem0 = self.c_mem + self.c_kv * kv_first  # memory time at step 1
        slope = self.c_kv * n

        def mem_sum(lo: int, hi: int) -> float:  # sum of memory time over steps lo..hi
            m = hi - lo + 1
            return m * mem0 + slope * (lo + hi - 2) * m / 2 if m > 0 else 0.0

        if not self.overlap:
            return (b - a + 1) * fixed + mem_sum(a, b)
        comp = self.c_tok * n
        # first step whose memory time reaches the compute time
        cross = a if mem0 + slope * (a - 1) >= comp else (
            b + 1 if slope <= 0 else max(a, 1 + math.ceil((comp - mem0) / slope)))
        cross = min(cross, b + 1)
        return (b - a + 1) * fixed + (cross - a) * comp + mem_sum(cross, b)

    @property
    def prefill_tokens_per_s(self) -> float:
        return 1.0 / max(self.c_tok, 1e-12)

    def transfer(self) -> TransferCost:
        return TransferCost(self.bytes_per_token, self.link_bytes_per_s, self.pcie_bytes_per_s,
                            self.prefill_tokens_per_s)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


PRESETS: dict[str, CostModel] = {
    "h200-llama8b": CostModel(
        "h200-llama8b", c0=1.5e-3, c_tok=29.5e-6, c_kv=34e-9, c_seq=5e-6, c_mem=4.2e-3,
        bytes_per_token=131072, kv_capacity_tokens=800_000,
        pcie_bytes_per_s=50e9, link_bytes_per_s=25e9,
        max_num_seqs=1024, max_num_batched_tokens=16384,  # vLLM LLM-class default, >= 70 GiB
        source="derived from the H200 spec sheet (4.8 TB/s, 989 TFLOP/s), Llama-3.1-8B bf16"),
    "a100-qwen0.5b": CostModel(
        "a100-qwen0.5b", c0=2.4e-3, c_tok=7.9e-6, c_kv=7.7e-9, c_seq=5e-6, c_mem=0.6e-3,
        bytes_per_token=12288, kv_capacity_tokens=5_500_000,
        pcie_bytes_per_s=25e9, link_bytes_per_s=12.5e9,
        max_num_seqs=256, max_num_batched_tokens=8192,  # vLLM LLM-class default on an A100
        source="derived from the A100-80GB spec sheet (2.0 TB/s, 312 TFLOP/s), Qwen2.5-0.5B bf16"),
    # fitted by `python -m batchgen_lab.sim calibrate` on the 2-core development VM, shared
    # with other jobs (load 7-11; each step's fastest of 3 runs kept; median error 17%)
    "cpu-smollm2": CostModel(
        "cpu-smollm2", c0=71.5e-3, c_tok=1.92e-3, c_kv=5.9e-6, c_seq=0.0,
        bytes_per_token=46080, kv_capacity_tokens=46592,
        pcie_bytes_per_s=10e9, link_bytes_per_s=1.25e9,
        max_num_seqs=256, max_num_batched_tokens=16384,
        source="calibrate, 2026-11-29: SmolLM2-135M fp32 on a 2-core Xeon VM, 48 steps"),
}
DEFAULT_PRESET = "h200-llama8b"


def scaled(cost: CostModel, factor: float) -> CostModel:
    """The same device `factor` times slower at every step (a straggler: thermal throttling, a
    noisy neighbour, an older GPU); memory, KV size and link speeds are unchanged."""
    if factor == 1.0:
        return cost
    if factor <= 0:
        raise ValueError(f"factor={factor!r}: must be > 0")
    return replace(cost, name=f"{cost.name}x{factor:g}", c0=cost.c0 * factor,
                   c_tok=cost.c_tok * factor, c_kv=cost.c_kv * factor,
                   c_seq=cost.c_seq * factor, c_mem=cost.c_mem * factor)


def get_preset(name: str) -> CostModel:
    """A preset by name, or a JSON file written by `calibrate`."""
    if name in PRESETS:
        return PRESETS[name]
    path = Path(name)
    if path.suffix == ".json" and path.exists():
        return CostModel(**json.loads(path.read_text()))
    raise ValueError(f"unknown cost-model preset {name!r}; valid: {sorted(PRESETS)} or a .json file")
