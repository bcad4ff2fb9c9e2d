"""The per-prompt arguments of `LLM.generate`, checked and spread over the prompts as vLLM
does: `sampling_params`, `lora_request` and `priority` may each be one value for every prompt
or a list with one per prompt (whose length must be the prompts'). And vLLM's prompt types:
a prompt is a string, a `TextPrompt` or a `TokensPrompt` (plain dicts)."""
from __future__ import annotations

from typing import Any, NotRequired, TypedDict, Union

from batchgen_data.lora_request import LoRARequest
from batchgen_data.sampling_params import SamplingParams


class TextPrompt(TypedDict):
    """vLLM's text prompt: `{"prompt": str}` (multimodal fields are not supported)."""

    prompt: str


class TokensPrompt(TypedDict):
    """vLLM's token prompt: `{"prompt_token_ids": [int]}`, with its text if known."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]


PromptType = Union[str, TextPrompt, TokensPrompt, dict[str, Any]]


def params_list(sp: Any, n: int) -> list[SamplingParams]:
    """vLLM's `sampling_params`: None (the defaults), one for every prompt, or one per prompt."""
    if sp is None:
        return [SamplingParams()] * n
    if isinstance(sp, SamplingParams):
        return [sp] * n
    sp = list(sp)
    if len(sp) != n:
        raise ValueError(f"sampling_params: got {len(sp)} for {n} prompts")
    for i, p in enumerate(sp):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling_params[{i}] must be SamplingParams")
    return sp


def lora_list(lora: Any, n: int) -> list[LoRARequest | None]:
    """vLLM's `lora_request`: one for all prompts, or one (or None) per prompt."""
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    if not isinstance(lora, (list, tuple)):
        raise TypeError(f"lora_request must be a LoRARequest or a list of them, got "
                        f"{type(lora).__name__}")
    if len(lora) != n:
        raise ValueError(f"lora_request: got {len(lora)} for {n} prompts")
    for i, lr in enumerate(lora):
        if lr is not None and not isinstance(lr, LoRARequest):
            raise TypeError(f"lora_request[{i}] must be a LoRARequest or None")
    return list(lora)


def check_priority(priority: Any, n: int) -> None:
    """vLLM's `priority`: an int for every prompt, or one per prompt."""
    values = priority if isinstance(priority, (list, tuple)) else [priority]
    if isinstance(priority, (list, tuple)) and len(priority) != n:
        raise ValueError(f"priority: the lengths of prompts ({n}) and priority "
                         f"({len(priority)}) must be the same.")
    for v in values:
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            raise TypeError(f"priority must be an int or a list of ints, got "
                            f"{type(v).__name__}: {v!r}")
