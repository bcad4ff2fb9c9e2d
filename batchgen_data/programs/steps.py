"""A program step between the program and the engine: `Generate` → request → `GenerateResult`.

A step's prompt reaches the model exactly as the same call by hand would send it: `messages`
through the chat template as `LLM.chat` renders them, a `prompt` as written as `LLM.generate`
encodes it, token ids unchanged. So a program's outputs equal the same steps run one by one
with `LLM.generate`/`LLM.chat` (greedy or seeded), and the next step's prompt, which repeats the
previous conversation, shares its KV prefix (see core/pins.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from batchgen_data.inputs.chat import render_chat
from batchgen_data.outputs import RequestOutput
from batchgen_data.programs.api import Generate, GenerateResult
from batchgen_data.sampling_params import SamplingParams

Check = Callable[[list[int], SamplingParams], None]


@dataclass(frozen=True, slots=True)
class StepRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    user_turns: list[dict[str, Any]]  # the conversation before the reply


def render(step: Generate, tokenizer: Any, defaults: SamplingParams | None = None,
           check: Check | None = None) -> StepRequest:
    """The engine request for one Generate; ValueError naming the problem when it has none."""
    params = step.params(defaults)
    if step.messages is not None:
        ids, text = render_chat(tokenizer, step.messages)
        turns = [dict(m) for m in step.messages]
    elif step.prompt is not None:
        if not isinstance(step.prompt, str) or not step.prompt:
            raise ValueError("Generate.prompt must be a non-empty string")
        ids, text = tokenizer.encode(step.prompt), step.prompt
        turns = [{"role": "user", "content": step.prompt}]
    else:
        ids, text, turns = list(step.prompt_token_ids or []), None, []
    if check is not None:
        check(ids, params)
    return StepRequest(ids, params, text, turns)


def seeded_step(req: StepRequest, seed: int | None) -> StepRequest:
    """`req` with `seed` when the program gave none (connectors derive one per row and step)."""
    if seed is None or req.params.seed is not None:
        return req
    return replace(req, params=replace(req.params, seed=seed))


def result_of(req: StepRequest, out: RequestOutput) -> GenerateResult:
    c = out.outputs[0]
    reply = {"role": "assistant", "content": c.text}
    return GenerateResult(text=c.text, token_ids=list(c.token_ids), finish_reason=c.finish_reason,
                          prompt_token_ids=list(out.prompt_token_ids),
                          conversation=[*req.user_turns, reply],
                          num_cached_tokens=out.num_cached_tokens, logprobs=c.logprobs)
