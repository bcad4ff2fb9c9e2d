"""Chat rendering, once for `LLM.chat` and both connectors.

OpenAI-style messages go through the tokenizer's chat template with the generation prompt
appended; the rendered text already holds the template's special tokens, so it is encoded
without adding more. A plain prompt meets a chat model as one user turn (`prompt_as_chat`).

As in vLLM and `ray.data.llm`, a custom Jinja `chat_template` replaces the tokenizer's, and
`chat_template_kwargs` reach the template as variables (e.g. `enable_thinking=False` for
Qwen3-style templates).
"""
from __future__ import annotations

from typing import Any

from batchgen_data.inputs.prompt_checks import shown

# the roles of OpenAI's chat API (vLLM accepts the same)
ROLES = ("system", "user", "assistant", "tool", "developer", "function")


# arguments of apply_chat_template that this module sets itself
_RESERVED = frozenset({"conversation", "tokenize", "add_generation_prompt", "chat_template",
                       "return_dict", "return_tensors"})


def has_chat_template(tokenizer: Any, chat_template: str | None = None) -> bool:
    return bool(chat_template) or bool(getattr(tokenizer, "chat_template", None))


def check_template_kwargs(kwargs: Any) -> dict[str, Any]:
    """`chat_template_kwargs` as a dict, or ValueError naming what is wrong."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(f"chat_template_kwargs must be a dict with string keys, got {kwargs!r}")
    reserved = sorted(_RESERVED & set(kwargs))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {reserved}: they are set by the "
                         "renderer (use chat_template= for a custom template)")
    return dict(kwargs)


def clean_messages(messages: Any) -> list[dict[str, Any]]:
    """The messages as plain dicts, or ValueError naming the first bad one.

    Keys whose value is None are dropped: an Arrow list of structs fills every absent field.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': str, 'content': str}, "
                         f"got {shown(messages)}")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        m = {k: v for k, v in m.items() if v is not None}
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] needs string 'role' and 'content': got "
                             f"{shown(m)}")
        if m["role"] not in ROLES:  # most templates would print any role as plain text
            raise ValueError(f"messages[{i}] has an unknown role: {m['role']!r}; "
                             f"use one of {list(ROLES)}")
        clean.append(m)
    return clean


def render_chat(tokenizer: Any, messages: Any, add_generation_prompt: bool = True,
                chat_template: str | None = None,
                chat_template_kwargs: dict[str, Any] | None = None) -> tuple[list[int], str]:
    """(prompt_token_ids, rendered text) for one conversation; ValueError when it cannot be."""
    clean = clean_messages(messages)
    extra = check_template_kwargs(chat_template_kwargs)
    if chat_template is not None:
        extra["chat_template"] = chat_template
    try:
        text = tokenizer.apply_chat_template(clean, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **extra)
    except Exception as e:  # a template may reject a role order, e.g. two user turns
        raise ValueError(f"chat template failed on messages: {e}") from None
    return tokenizer.encode(text, add_special_tokens=False), text


def prompt_as_chat(tokenizer: Any, prompt: str, chat_template: str | None = None,
                   chat_template_kwargs: dict[str, Any] | None = None) -> tuple[list[int], str]:
    """A plain prompt as the one user turn of a conversation."""
    return render_chat(tokenizer, [{"role": "user", "content": prompt}], True, chat_template,
                       chat_template_kwargs)
