"""The runner a step drives (PEP 544): the one way the engine reaches the model.

`engine/stepper.py` (and `engine/step_failure.py`, which runs parts of a failed step again)
schedule a step, then ask the runner to `prepare` it into a `StepInput`, `run` it into logits,
hand out a `mark` in the device's queue to wait on, and report what the step cost. Hold,
resume, export and import move a sequence's KV through `read_kv` / `write_kv`. Three kinds
implement it: `ModelRunner` (one device, worker/model_runner.py), the tensor-parallel rank 0
(`TPRunner`, worker/tp/runner.py), and runners given to an engine in its parts
(`Engine(config, parts)`): the lab's emulated runner, the benchmarks' stub, tests' fakes.
The stepper asks capabilities (`can_overlap`), never the runner's class.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch

from batchgen_data.core.kv.held_kv import KVCopy
from batchgen_data.core.scheduler_output import SchedulerOutput
from batchgen_data.core.sequence import Sequence
from batchgen_data.worker.device_mark import DeviceMark

if TYPE_CHECKING:
    from batchgen_data.worker.lora_manager import LoRAManager


@runtime_checkable
class StepInput(Protocol):
    """What a prepared step tells the engine besides its logits."""

    # the sequences whose next token is sampled, in the order of the logits' rows
    sample_seqs: list[Sequence]
    # the scheduled index of each flattened sequence (None: the scheduled order)
    order: list[int] | None
    # prompt_logprobs entries computed by the run, per collecting sequence (None: none asked)
    prompt_logprobs: list[tuple[Sequence, Any]] | None
    # the step's sequences with their computed tokens and token counts once it is done, for
    # `Scheduler.after_step` (None: it reads them from the sequences)
    flat: tuple[list[Sequence], np.ndarray, np.ndarray] | None


@runtime_checkable
class Runner(Protocol):
    """What a step drives. A runner that cannot do something says so through a capability
    (`can_overlap`) or a neutral report (`device_step_s` None, zero counters)."""

    # the adapters' manager when the engine runs LoRA requests (enable_lora), else None
    lora: LoRAManager | None

    @property
    def can_overlap(self) -> bool:
        """Whether step n+1 may be prepared and queued while step n runs
        (`async_scheduling`, engine/overlap.py): its `run` reads no sequence state but the
        prepared input, and its input has the `input_ids` a look-ahead fills."""
        ...

    def prepare(self, out: SchedulerOutput) -> StepInput:
        """The scheduled step as the runner's input; changes no sequence."""
        ...

    def run(self, inp: Any) -> torch.Tensor:
        """Logits [S, vocab] float32 of `inp.sample_seqs`, possibly still being computed on
        the device (wait on `mark()`)."""
        ...

    def mark(self) -> DeviceMark:
        """A point in the device's queue after everything queued so far."""
        ...

    def device_step_s(self) -> float | None:
        """Seconds the device spent on the last `run` where the runner knows them apart from
        the host's; None: the engine times the step by the wall clock."""
        ...

    def take_expert_tokens(self, on_device: bool = False) -> torch.Tensor:
        """Tokens per expert of each MoE layer since the last call [moe_layers, experts]
        (empty without MoE layers)."""
        ...

    def offload_counters(self) -> tuple[int, int]:
        """(weight bytes streamed to the device so far, peak weight bytes resident)."""
        ...

    def kv_tier_counters(self) -> tuple[int, int]:
        """(KV bytes moved between the host tier and the device so far, most host-tier
        sequences in one step)."""
        ...

    def read_kv(self, block_ids: list[int], num_tokens: int) -> KVCopy:
        """A host copy of the first `num_tokens` tokens' KV in these blocks."""
        ...

    def write_kv(self, block_ids: list[int], kv: KVCopy) -> None:
        """Write a host copy (`read_kv`'s form) into these blocks."""
        ...

    def close(self) -> None:
        """Release what the runner started (a tensor-parallel engine's ranks)."""
        ...
