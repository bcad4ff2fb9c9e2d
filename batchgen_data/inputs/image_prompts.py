"""`LLM.chat` / `LLM.generate` prompts with images: every conversation prepared at once.

Each image conversation goes to the preparer's pool as it is read, so the conversations of one
call are fetched, decoded and processed side by side; the call waits for them all before it
submits anything, so a bad image fails the call before any request half-runs (as a bad prompt
does). Conversations without image parts render as before; text parts sent to a text-only model
are joined into a string (OpenAI's text parts mean the same), image parts to it are refused.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from batchgen_data.inputs.image_parts import TEXT_ONLY, has_parts, text_only
from batchgen_data.inputs.images import ImagePreparer

Render = Callable[[Any], tuple[list[int], str]]


def chat_prompts(preparer: Callable[[], ImagePreparer | None], render: Render,
                 conversations: Sequence[Any], add_generation_prompt: bool = True,
                 chat_template: str | None = None,
                 chat_template_kwargs: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """One token prompt per conversation (`mm_inputs` where it has images); the first bad one
    raises: a text conversation the chat module's ValueError, one with content parts a
    ValueError naming `conversations[i]`. `preparer` is asked only when a conversation holds
    content parts (it may load the model's processor)."""
    pending: list[Future | dict[str, Any]] = []
    for i, conv in enumerate(conversations):
        if not has_parts(conv):  # a text conversation's error is the chat module's, as is
            try:
                pending.append(_tokens(*render(conv)))
            except BaseException:
                _cancel(pending)
                raise
            continue
        try:
            prep = preparer()
            if prep is None:
                pending.append(_tokens(*render(text_only(conv))))
                continue
            pending.append(prep.submit_chat(conv, (), add_generation_prompt, chat_template,
                                            chat_template_kwargs))
        except (TypeError, ValueError) as e:
            _cancel(pending)
            raise type(e)(f"conversations[{i}]: {e}") from None
    return _collect(pending, "conversations")


def generate_prompts(preparer: Callable[[], ImagePreparer | None],
                     prompts: Sequence[Any]) -> list[Any]:
    """vLLM's `{"prompt": text, "multi_modal_data": {"image": img | [img, ...]}}` prompts as
    token prompts with `mm_inputs` (the text holds one image token per image, as vLLM wants);
    other prompts unchanged."""
    pending: list[Any] = []
    for i, p in enumerate(prompts):
        data = p.get("multi_modal_data") if isinstance(p, dict) else None
        if not data:
            pending.append(p)
            continue
        try:
            pending.append(_submit_raw(preparer, p, data))
        except (TypeError, ValueError) as e:
            _cancel(pending)
            raise type(e)(f"prompts[{i}]: {e}") from None
    return _collect(pending, "prompts")


def _collect(pending: list[Any], name: str) -> list[Any]:
    """Each prepared image prompt as a token prompt, in order (the rest as they are); the
    first that failed raises naming `name[i]`, the others cancelled."""
    out = []
    for i, p in enumerate(pending):
        if not isinstance(p, Future):
            out.append(p)
            continue
        try:
            ready = p.result()
        except (TypeError, ValueError) as e:
            _cancel(pending)
            raise type(e)(f"{name}[{i}]: {e}") from None
        out.append(_tokens(ready.prompt_token_ids, ready.prompt, list(ready.images)))
    return out


def _submit_raw(preparer: Callable[[], ImagePreparer | None], prompt: dict[str, Any],
                data: Any) -> Future:
    if not isinstance(data, Mapping) or set(data) - {"image"}:
        raise ValueError(f"multi_modal_data: only {{'image': ...}} is supported, got "
                         f"{sorted(data) if isinstance(data, Mapping) else type(data).__name__}")
    if not isinstance(prompt.get("prompt"), str):
        raise ValueError("multi_modal_data needs a text 'prompt' holding the image tokens")
    prep = preparer()
    if prep is None:
        raise ValueError(f"multi_modal_data: {TEXT_ONLY}")
    images = data["image"]
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    return prep.submit_prompt(prompt["prompt"], images, as_chat=False)


def mm_kwargs(prompt: Any) -> dict[str, Any]:
    """`mm_inputs=` for the engine's submit when a token prompt carries images (engines and
    fakes that never see an image need not know the argument)."""
    mm = prompt.get("mm_inputs") if isinstance(prompt, dict) else None
    return {"mm_inputs": list(mm)} if mm else {}


def _tokens(ids: list[int], text: str, images: list[Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_token_ids": ids, "prompt": text}
    if images:
        out["mm_inputs"] = images
    return out


def _cancel(pending: list[Any]) -> None:
    for p in pending:
        if isinstance(p, Future):
            p.cancel()
