"""OpenAI content parts in chat messages: the text and image parts split apart.

A message's `content` is a string or a list of parts. The parts read here are vLLM's and the
HF processors': `{"type": "text", "text": ...}`, `{"type": "image_url", "image_url": {"url":
...}}` (or the URL as a plain string), the Responses API's `{"type": "input_image",
"image_url": ...}`, and `{"type": "image", "image": <source>}` (also `url` / `path`). An image
part without a source takes the row's next image from its image column (`image` or `images`):
a table row names its picture once, in a column, and its prompt says where it goes. Anything
else (audio, video, files) is refused by name, as is an image part sent to a text-only model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchgen_data.inputs.chat import ROLES
from batchgen_data.inputs.prompt_checks import shown

IMAGE_COLUMNS = ("image", "images")  # a row's images: one in `image`, a list in `images`
_IMAGE_TYPES = ("image_url", "input_image", "image")
TEXT_ONLY = ("the model takes no images (text-only: its directory has no image processor); "
             "send text content only or load a vision-language model")


@dataclass(frozen=True)
class SplitMessages:
    """Messages as the chat template takes them (image parts as `{"type": "image"}`) and each
    image part's source, in order (None: the row's image column supplies it)."""

    messages: list[dict[str, Any]]
    sources: list[Any]


def has_parts(messages: Any) -> bool:
    """True when some message's content is a list of parts (not a plain string)."""
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list) for m in messages)


def _image_source(part: dict[str, Any], where: str) -> Any:
    kind = part["type"]
    if kind in ("image_url", "input_image"):
        ref = part.get("image_url")
        if isinstance(ref, dict):
            ref = {k: v for k, v in ref.items() if v is not None}.get("url")
        if not isinstance(ref, str) or not ref:
            raise ValueError(f"{where}: an {kind} part needs image_url {{'url': str}}, got "
                             f"{shown(part.get('image_url'))}")
        return ref
    for key in ("image", "url", "path"):
        if part.get(key) is not None:
            return part[key]
    return None


def _split_content(content: list[Any], where: str, sources: list[Any]) -> list[dict[str, Any]]:
    parts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise ValueError(f"{at} must be a dict content part, got {type(part).__name__}")
        part = {k: v for k, v in part.items() if v is not None}
        kind = part.get("type")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ValueError(f"{at}: a text part needs a string 'text', got {shown(part)}")
            parts.append({"type": "text", "text": part["text"]})
        elif kind in _IMAGE_TYPES:
            sources.append(_image_source(part, at))
            parts.append({"type": "image"})
        else:
            raise ValueError(f"{at}: content part of type {kind!r} is not supported (text and "
                             "image parts: text, image_url, input_image, image)")
    return parts


def split_messages(messages: Any) -> SplitMessages:
    """The template's messages and the image sources; ValueError naming the first bad part."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list of messages, got {shown(messages)}")
    clean, sources = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        m = {k: v for k, v in m.items() if v is not None}
        if m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}] has an unknown role: {shown(m.get('role'))}; use "
                             f"one of {list(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):
            m["content"] = _split_content(content, f"messages[{i}]", sources)
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}] needs string or list 'content': got {shown(m)}")
        clean.append(m)
    return SplitMessages(clean, sources)


def text_only(messages: Any) -> Any:
    """Messages for a text-only model: text parts joined into a string; ValueError when a
    message holds an image part."""
    if not has_parts(messages):
        return messages
    split = split_messages(messages)
    if split.sources:
        raise ValueError(f"messages hold {len(split.sources)} image part(s): {TEXT_ONLY}")
    return [{**m, "content": "".join(p["text"] for p in m["content"])}
            if isinstance(m["content"], list) else m for m in split.messages]


def fill_sources(sources: list[Any], column_images: list[Any]) -> list[Any]:
    """The image parts' sources, those without one taken from the row's image column in
    order; ValueError when the counts differ."""
    empty = sum(s is None for s in sources)
    if empty != len(column_images) and (empty or column_images):
        raise ValueError(f"messages have {empty} image part(s) without a source but the row's "
                         f"image column holds {len(column_images)} image(s)")
    given = iter(column_images)
    return [next(given) if s is None else s for s in sources]


def column_images(row: dict[str, Any]) -> list[Any]:
    """The images in a row's `image` / `images` columns (null: none), in that order."""
    out: list[Any] = []
    if row.get("image") is not None:
        out.append(row["image"])
    many = row.get("images")
    if many is not None:
        if not isinstance(many, (list, tuple)):
            raise ValueError(f"images must be a list of images, got {type(many).__name__}")
        out.extend(many)
    return out
