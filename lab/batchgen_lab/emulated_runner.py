"""Emulated compute: a model runner that sleeps each step's modelled time instead of computing.

Used to run the *real* engine (scheduler, coroutines, sampler), connector, coordinator and
migration protocol at a scale the development box cannot compute (16-32 Ray actors on 2 cores).
`build_engine(model, **engine_kwargs)` is a real `Engine` built from the parts this module
makes (`Engine(config, parts)`, through the runner Protocol of batchgen_data/worker/runner.py),
its model string

    model="emulated:h200-llama8b?scale=0.1&slowdown=1.5&tokens_per_step=64"

* the preset (or a calibrate `.json`) is the simulator's step-cost model (`sim/costmodel.py`):
  a step computing `new` tokens for `n` sequences over `kv` context tokens lasts
  `CostModel.step_time(new, kv, n)` modelled seconds, the same formula the simulator charges;
* `scale` stretches wall time: the runner sleeps `step_time x slowdown x scale`, so the real
  Python/Ray overhead of a step is small next to the sleep (`overhead()` measures it);
* `slowdown` makes this engine a straggler (1.5: every step 1.5x slower);
* `tokens_per_step` (g) coarsens time: one emulated token stands for g real tokens and one
  emulated step for g decode steps (`coarsen`), so a 16k-token row takes 16k / g steps. Rows
  then finish and join on g-token boundaries; run the simulator on the same coarse cost model
  (`coarsen(preset, g)`) and the same coarse lengths to compare like with like.

Nothing is computed: the output length of a row is written into its prompt (`encode_prompt`),
and the runner emits deterministic tokens and EOS at that length. The engine never reads the
length (its `max_tokens` stays at the job's cap), so the scheduler and placement policy see a
row exactly as they would see a real one. Exported and imported rows keep their prompt, so a
moved row still stops at its length. KV is not stored: moving it costs its bytes over PCIe
(`CostModel.pcie_bytes_per_s`) in sleep, like the simulator's swap charge.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

import torch

from batchgen_data.core.scheduler import SchedulerOutput
from batchgen_data.core.sequence import Sequence
from batchgen_data.core.kv.held_kv import KVCopy

from batchgen_data.worker.device_mark import DONE, DeviceMark

if TYPE_CHECKING:
    from batchgen_data.config import EngineConfig
    from batchgen_data.engine.engine import Engine
    from batchgen_data.engine.setup import EngineParts
    from batchgen_lab.sim.costmodel import CostModel

PREFIX = "emulated:"
VOCAB = 512
EOS = 1
_HEADER = 256  # prompt[0] = _HEADER + length // 256, prompt[1] = _HEADER + length % 256
MAX_OUTPUT = (VOCAB - _HEADER) * 256 - 1
_DEFAULT_MAX_LEN = 1 << 17


def is_emulated(model: str | None) -> bool:
    return isinstance(model, str) and model.startswith(PREFIX)


@dataclass(frozen=True, slots=True)
class EmulatedSpec:
    preset: str = "h200-llama8b"
    scale: float = 1.0  # wall seconds slept per modelled second
    slowdown: float = 1.0  # this engine's steps take this many times the modelled time
    tokens_per_step: int = 1  # real tokens one emulated token stands for

    def __post_init__(self) -> None:
        if not isinstance(self.tokens_per_step, int) or self.tokens_per_step < 1:
            raise ValueError(f"emulated tokens_per_step={self.tokens_per_step!r}: must be an "
                             "int >= 1")
        if not self.scale > 0:
            raise ValueError(f"emulated scale={self.scale!r}: must be > 0")
        if not self.slowdown > 0:
            raise ValueError(f"emulated slowdown={self.slowdown!r}: must be > 0")

    @classmethod
    def parse(cls, model: str) -> "EmulatedSpec":
        if not is_emulated(model):
            raise ValueError(f"model={model!r}: an emulated model starts with {PREFIX!r}")
        parts = urlsplit(model[len(PREFIX):])
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        unknown = sorted(set(query) - {"scale", "slowdown", "tokens_per_step"})
        if unknown:
            raise ValueError(f"model={model!r}: unknown option(s) {unknown}; valid: scale, "
                             "slowdown, tokens_per_step")
        return cls(parts.path or "h200-llama8b", float(query.get("scale", 1.0)),
                   float(query.get("slowdown", 1.0)), int(query.get("tokens_per_step", 1)))

    def model_string(self) -> str:
        return (f"{PREFIX}{self.preset}?scale={self.scale!r}&slowdown={self.slowdown!r}"
                f"&tokens_per_step={self.tokens_per_step}")

    def cost_model(self) -> CostModel:
        from batchgen_lab.sim.costmodel import get_preset
        return coarsen(get_preset(self.preset), self.tokens_per_step)


def coarsen(cost: CostModel, g: int) -> CostModel:
    """The cost model of an engine whose token stands for `g` real tokens and whose step stands
    for `g` real decode steps: each step term costs g times (c0, c_mem, c_seq; c_tok per coarse
    token = g real tokens), a coarse KV token read g times over holds g real tokens (g**2), and
    capacity and bytes count coarse tokens. A prefill-only step is over-charged (g - 1) x
    (c0 + c_mem): the price of coarse time."""
    if g == 1:
        return cost
    return dataclasses.replace(
        cost, name=f"{cost.name}/g{g}", c0=cost.c0 * g, c_mem=cost.c_mem * g, c_tok=cost.c_tok * g,
        c_seq=cost.c_seq * g, c_kv=cost.c_kv * g * g, bytes_per_token=cost.bytes_per_token * g,
        kv_capacity_tokens=max(1, cost.kv_capacity_tokens // g))


def encode_prompt(output_len: int, prompt_len: int, salt: int = 0) -> list[int]:
    """Prompt token ids of `prompt_len` (>= 2) tokens that make the runner stop after
    `output_len` generated tokens (the last of them EOS). Rows with different `salt` (a row id)
    share no prefix block, as real prompts would not."""
    if not 1 <= output_len <= MAX_OUTPUT:
        raise ValueError(f"output_len={output_len!r}: must be in [1, {MAX_OUTPUT}]")
    if salt < 0:
        raise ValueError(f"salt={salt!r}: must be >= 0")
    digits = [2 + salt // 250 ** k % 250 for k in range(3)]  # unique below 250**3 rows
    filler = (digits + [2 + i % 250 for i in range(prompt_len)])[:max(prompt_len, 2) - 2]
    return [_HEADER + output_len // 256, _HEADER + output_len % 256] + filler


def output_len_of(prompt_token_ids: list[int]) -> int:
    if len(prompt_token_ids) < 2 or min(prompt_token_ids[:2]) < _HEADER:
        raise ValueError("prompt was not made by emulated_runner.encode_prompt")
    return (prompt_token_ids[0] - _HEADER) * 256 + prompt_token_ids[1] - _HEADER


def next_token(seq: Sequence) -> int:
    """The token this sequence generates next: EOS at its prescribed length, else filler."""
    i = seq.num_output_tokens
    return EOS if i + 1 >= output_len_of(seq.prompt_token_ids) else 2 + i % 250


@dataclass(frozen=True, slots=True)
class _Shape:
    vocab: int


class EmulatedModel:
    """Stands where the model sits in `EngineParts`: the engine reads only its shape."""

    def __init__(self) -> None:
        self.shape = _Shape(VOCAB)


@dataclass
class EmulatedInput:
    """The runner Protocol's `StepInput`: rows in the scheduled order, no prompt logprobs."""

    sample_seqs: list[Sequence]
    seconds: float  # modelled step time, before slowdown and scale
    seq_ids: frozenset[int]
    prompt_logprobs: None = None
    order: None = None
    flat: None = None


class EmulatedRunner:
    """The runner Protocol (batchgen_data/worker/runner.py), with sleeping in place of
    computing. Its steps end when `run` returns, so they do not overlap."""

    can_overlap = False

    def __init__(self, cost: CostModel, spec: EmulatedSpec) -> None:
        self.cost = cost
        self.spec = spec
        self.lora = None  # ModelRunner's LoRA manager: no adapters here
        self.modelled_s = 0.0  # modelled seconds of all steps (slowdown included)
        self.slept_s = 0.0
        # overhead: wall time between two steps of a busy engine (schedule, sample, coroutines,
        # driver loop), summed with the sleeps of the steps it preceded
        self.gap_s = 0.0
        self.busy_sleep_s = 0.0
        self.num_steps = 0
        self.first_step_at: float | None = None  # time.time() of the first step (dispatch lag)
        self._last_end: float | None = None
        self._overshoot = 0.0  # seconds slept beyond what was asked, not yet paid back
        self._last_ids: frozenset[int] = frozenset()
        self._device_s: float | None = None  # the last step's emulated device time, wall s

    def prepare(self, out: SchedulerOutput) -> EmulatedInput:
        kv = sum(s.num_computed_tokens + n for s, n in zip(out.seqs, out.num_new_tokens))
        seconds = self.cost.step_time(out.total_tokens, kv, len(out.seqs))
        sample = [s for s, n in zip(out.seqs, out.num_new_tokens)
                  if s.num_computed_tokens + n == s.num_tokens]
        return EmulatedInput(sample, seconds, frozenset(s.seq_id for s in out.seqs))

    def run(self, inp: EmulatedInput) -> torch.Tensor:
        """Sleep the step, then logits [S, VOCAB] that greedy sampling turns into `next_token`."""
        start = time.perf_counter()
        if self.first_step_at is None:
            self.first_step_at = time.time()
        # a sequence of the last step is still here: the engine was busy, not waiting for rows
        busy = self._last_end is not None and not self._last_ids.isdisjoint(inp.seq_ids)
        self._sleep(inp.seconds * self.spec.slowdown)
        self._device_s = inp.seconds * self.spec.slowdown * self.spec.scale
        end = time.perf_counter()
        if busy:
            self.gap_s += start - self._last_end  # type: ignore[operator]
            self.busy_sleep_s += end - start
        self._last_end, self._last_ids = end, inp.seq_ids
        self.num_steps += 1
        logits = torch.zeros(len(inp.sample_seqs), VOCAB)
        if inp.sample_seqs:
            rows = torch.arange(len(inp.sample_seqs))
            logits[rows, torch.tensor([next_token(s) for s in inp.sample_seqs])] = 1.0
        return logits

    def _sleep(self, modelled: float) -> None:
        # a loaded box wakes sleepers late (ms): carry the overshoot into the next sleep, so
        # total wall time slept tracks total modelled time x scale instead of drifting
        self.modelled_s += modelled
        want = modelled * self.spec.scale - self._overshoot
        t0 = time.perf_counter()
        if want > 0:
            time.sleep(want)
        took = time.perf_counter() - t0
        self._overshoot = took - want
        self.slept_s += took

    def device_step_s(self) -> float | None:
        """The last step's emulated device time in wall seconds (modelled x slowdown x scale):
        what a GPU would report for it. Not the wall time of the sleep: on a box running 16
        engines on 2 cores, sleepers wake late and `_sleep` pays that back in the next step,
        so wall times read both high (contention) and low (payback) at random, and an engine's
        fastest step would say nothing about its device."""
        return self._device_s

    def overhead(self) -> float:
        """Fraction of a busy engine's wall time spent outside the emulated compute."""
        total = self.gap_s + self.busy_sleep_s
        return self.gap_s / total if total else 0.0

    def mark(self) -> DeviceMark:
        return DONE  # the sleep is over when `run` returns

    def close(self) -> None:
        return None

    def take_expert_tokens(self, on_device: bool = False) -> torch.Tensor:
        return torch.zeros(0, 0, dtype=torch.long)

    def offload_counters(self) -> tuple[int, int]:
        return (0, 0)

    def kv_tier_counters(self) -> tuple[int, int]:
        return (0, 0)

    def read_kv(self, block_ids: list[int], num_tokens: int) -> KVCopy:
        """No KV is stored: an empty [num_tokens, 0] pair, after the time its bytes would take."""
        self._sleep(num_tokens * self.cost.bytes_per_token / self.cost.pcie_bytes_per_s)
        return [(torch.empty(num_tokens, 0), torch.empty(num_tokens, 0))]

    def write_kv(self, block_ids: list[int], kv: KVCopy) -> None:
        self._sleep(kv[0][0].shape[0] * self.cost.bytes_per_token / self.cost.pcie_bytes_per_s)


class EmulatedTokenizer:
    """Enough of a tokenizer for token-id rows: text is one letter per token."""

    eos_token_id = EOS

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("" if t == EOS and skip_special_tokens else chr(97 + t % 26) for t in ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise ValueError("an emulated model takes prompt_token_ids rows only "
                         "(emulated_runner.encode_prompt), not text")


def build_engine(model: str, **engine_kwargs: Any) -> Engine:
    """A real `Engine` over `build_parts` of the emulated `model` string; `engine_kwargs` as
    `Engine.from_kwargs` takes them."""
    from batchgen_data.config import make_engine_config
    from batchgen_data.engine.engine import Engine

    config = make_engine_config(model, **engine_kwargs)
    return Engine(config, build_parts(config))


def build_parts(config: EngineConfig) -> EngineParts:
    """`EngineParts` around an `EmulatedRunner`: KV pool sized by the preset's capacity."""
    from batchgen_data.engine.setup import EngineParts
    from batchgen_data.core.stop import StopChecker
    from batchgen_data.core.kv.block_pool import BlockPool
    from batchgen_data.core.kv.held_kv import HeldKVStore
    spec = EmulatedSpec.parse(config.model or "")
    cost = spec.cost_model()
    cc = config.cache
    max_len = config.max_model_len or _DEFAULT_MAX_LEN
    num_blocks = cc.num_kv_blocks or max(2, cost.kv_capacity_tokens // cc.block_size)
    tokenizer = EmulatedTokenizer()
    model: Any = EmulatedModel()  # stands where the torch module would
    return EngineParts(model, tokenizer, torch.device("cpu"), max_len,
                       BlockPool(num_blocks, cc.block_size, cc.enable_prefix_caching),
                       HeldKVStore(cc.held_kv_bytes, cost.bytes_per_token),
                       EmulatedRunner(cost, spec),  # type: ignore[arg-type]
                       StopChecker(tokenizer, {EOS}), config.scheduler)
