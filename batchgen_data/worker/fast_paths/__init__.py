"""Whole-model fast paths of the model runner: other ways to run one step's forward.

Each one serves only some steps (pure decodes up to some batch size) and produces the same
hidden states as the model's own forward for them:
    cuda_graphs.DecodeGraphs         captured CUDA graphs of decode steps (Triton path on CUDA)
    piecewise_graphs.MixedGraphs     CUDA graphs of any step up to a token count, captured in
                                     pieces between the attention calls (Triton path on CUDA)
    cpu_decode_stack.CpuDecodeStack  a decode step's whole layer stack as one C call (fp32 CPU)
`build_fast_paths` picks those that can run for a model and its cache; `ModelRunner.run` asks
them, in order, in one place, and runs the model's forward when none applies. A step with LoRA
adapters (`ModelInput.lora`) goes to a path only if it adds their deltas (the C stack does).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from batchgen_data.worker.model_input import ModelInput
    from batchgen_data.layers.backend import LayerBackend


class FastPath(Protocol):
    def applies(self, inp: ModelInput) -> bool:
        """Whether this path serves the step (checked on host-side values only)."""

    def run(self, inp: ModelInput) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of the step; call only if `applies(inp)`."""


def build_fast_paths(model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                     backend: LayerBackend, max_num_seqs: int, max_model_len: int,
                     block_size: int, cuda_graphs: bool = True,
                     max_num_batched_tokens: int | None = None) -> list[FastPath]:
    """The fast paths that can run `model` over `kv_caches` on `backend` (maybe none); mixed
    steps get piecewise graphs when the step's token budget is given."""
    from batchgen_data.worker.fast_paths.cpu_decode_stack import CpuDecodeStack
    from batchgen_data.worker.fast_paths.cuda_graphs import DecodeGraphs
    from batchgen_data.worker.fast_paths.piecewise_graphs import CudaPieces, MixedGraphs

    paths: list[FastPath] = []
    if cuda_graphs and backend.triton and backend.device.type == "cuda":
        decode = DecodeGraphs(model, kv_caches, max_num_seqs, max_model_len, block_size,
                              backend.device)
        paths.append(decode)
        if max_num_batched_tokens is not None and MixedGraphs.usable(model):
            # after the decode graphs (which take pure decodes whole), in the same pool
            paths.append(MixedGraphs(model, kv_caches, max_num_batched_tokens, backend.device,
                                     CudaPieces(backend.device, decode.pool)))
    stack = CpuDecodeStack.build(model, kv_caches, backend)
    if stack is not None:
        paths.append(stack)
    return paths
