"""One step as the runner lays it out for the model: `ModelRunner.prepare`'s output, read by
`ModelRunner.run` and by each fast path's `applies` / `run` (`fast_paths/`), which take it from
here rather than from the runner that calls them."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchgen_data.core.sequence import Sequence
from batchgen_data.layers.attention import AttentionMetadata
from batchgen_data.layers.lora import LoRABatch
from batchgen_data.sample import prompt_logprobs
from batchgen_data.worker.mm_step import MultiModalStep


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata  # micro-batches too, where the step attends in them
    sample_index: torch.Tensor  # [S] rows of the hidden states to sample from
    sample_seqs: list[Sequence]
    order: list[int]  # scheduled index of each flattened sequence
    # prompt_logprobs: rows whose logits are wanted (None: no sequence asks), and the result
    prompt_rows: prompt_logprobs.PromptRows | None = None
    prompt_logprobs: list[tuple[Sequence, prompt_logprobs.Entries]] | None = None
    # the rows that run under LoRA adapters, by device slot (None: the base model for all)
    lora: LoRABatch | None = None
    # the step's sequences in row order with, once the step is done, their computed tokens and
    # their token counts (a sampled one has its new token): `Scheduler.after_step` reads them
    flat: tuple[list[Sequence], np.ndarray, np.ndarray] | None = None
    # a model that takes images: the step's encoder batch and image rows (worker/mm_step.py);
    # its `positions` are then [3, T] (M-RoPE)
    mm: MultiModalStep | None = None
