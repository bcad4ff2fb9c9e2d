"""Chat rendering, once for `LLM.chat` and both connectors.

OpenAI-style messages go through the tokenizer's chat template with the generation prompt
appended; the rendered text already holds the template's special tokens, so it is encoded
without adding more. A plain prompt meets a chat model as one user turn (`prompt_as_chat`).
"""
from __future__ import annotations

from typing import Any

from batchgen_data.prompt_checks import shown

# the roles of OpenAI's chat API (vLLM accepts the same)
ROLES = ("system", "user", "assistant", "tool", "developer", "function")


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


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


def render_chat(tokenizer: Any, messages: Any, add_generation_prompt: bool = True
                ) -> tuple[list[int], str]:
    """(prompt_token_ids, rendered text) for one conversation; ValueError when it cannot be."""
    clean = clean_messages(messages)
    try:
        text = tokenizer.apply_chat_template(clean, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as e:  # a template may reject a role order, e.g. two user turns
        raise ValueError(f"chat template failed on messages: {e}") from None
    return tokenizer.encode(text, add_special_tokens=False), text


def prompt_as_chat(tokenizer: Any, prompt: str) -> tuple[list[int], str]:
    """A plain prompt as the one user turn of a conversation."""
    return render_chat(tokenizer, [{"role": "user", "content": prompt}])
