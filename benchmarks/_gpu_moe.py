"""MoE helpers for the GPU benchmark: whether the engine has Qwen3-MoE, and tokens per expert,
counted the same way for our engine and for HF transformers.

Tokens per expert per step is the expert batch size that expert-level batching is about: per
model forward, over every (MoE layer, expert) pair, the mean, least and most tokens an expert
received. Ours comes from the engine's own stats (`EngineStats.tokens_per_expert`); HF's from
forward hooks on its routers, accumulated on the device so that counting adds no host sync.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


def moe_available() -> bool:
    """The engine implements Qwen3-MoE (the MoE case is skipped, and says so, otherwise)."""
    from batchgen_data.models.registry import supported_architectures

    return "Qwen3MoeForCausalLM" in supported_architectures()


def expert_load_since(stats: Any, before: tuple[float, ...] | None) -> dict[str, float] | None:
    """Our engine's tokens per expert (mean/min/max per step) over the steps since `before`
    (a `expert_load_mark`), None for an engine without MoE stats."""
    load = getattr(stats, "tokens_per_expert", None)
    if load is None or before is None:
        return None
    now = expert_load_mark(stats)
    assert now is not None
    steps = now[0] - before[0]
    if steps <= 0:
        return None
    mean, low, high = ((a - b) / steps for a, b in zip(now[1:], before[1:]))
    return {"mean": round(mean, 2), "min": round(low, 2), "max": round(high, 2), "steps": steps}


def expert_load_mark(stats: Any) -> tuple[float, ...] | None:
    """The running sums of `EngineStats.tokens_per_expert`, to diff against later."""
    load = getattr(stats, "tokens_per_expert", None)
    if load is None:
        return None
    return (load.layer_steps, load.mean_sum, load.min_sum, load.max_sum)


@dataclass
class HFExpertCounter:
    """Counts the experts HF's Qwen3-MoE routers pick: hooks on every `*.mlp.gate` (a
    router returning (logits, scores, indices) in transformers 5, plain logits before) and on
    the top model, which closes one step per forward."""

    top_k: int
    steps: int = 0
    _layer_counts: list[torch.Tensor] = field(default_factory=list)
    _sums: torch.Tensor | None = None  # [3] mean, min, max summed over steps (on the device)
    _handles: list[Any] = field(default_factory=list)

    def attach(self, model: torch.nn.Module) -> "HFExpertCounter":
        for name, module in model.named_modules():
            if name.endswith("mlp.gate"):
                self._handles.append(module.register_forward_hook(self._on_router))
        self._handles.append(model.register_forward_hook(self._on_step))
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _on_router(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        num_experts = module.weight.shape[0]
        if isinstance(out, tuple):
            ids = out[-1]  # router_indices [T, k]
        else:
            ids = out.topk(self.top_k, -1).indices  # logits [T, E]
        self._layer_counts.append(torch.bincount(ids.reshape(-1), minlength=num_experts))

    def _on_step(self, *_: Any) -> None:
        if not self._layer_counts:
            return
        counts = torch.stack(self._layer_counts).float()  # [moe_layers, E]
        self._layer_counts.clear()
        row = torch.stack([counts.mean(), counts.min(), counts.max()])
        self._sums = row if self._sums is None else self._sums + row
        self.steps += 1

    def summary(self) -> dict[str, float] | None:
        if self._sums is None:
            return None
        mean, low, high = (self._sums / self.steps).tolist()
        return {"mean": round(mean, 2), "min": round(low, 2), "max": round(high, 2),
                "steps": self.steps}
