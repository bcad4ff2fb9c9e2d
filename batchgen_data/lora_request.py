"""`LoRARequest`: which adapter a prompt runs under, in vLLM's shape.

`LoRARequest(lora_name, lora_int_id, lora_path)`: `lora_path` is a local PEFT directory
(`adapter_config.json` + `adapter_model.safetensors`); `lora_int_id` (>= 1) is the adapter's
identity inside an engine: its device slot, its host copy and its prefix-cache key. Connectors
derive the id from the name (`stable_lora_id`), so the same adapter has the same id on every
worker and a row moved between engines keeps it. Plain data: it travels with an exported row.

How a row names its adapter (`AdapterNames.request`; the connectors, the command and
`LLM.run`'s programs all use it):
* `lora`: an adapter's name, found under the engine's `dynamic_lora_loading_path`, or (without
  one) a local PEFT directory; a dict `{"lora_name", "lora_path", "lora_int_id"?}` gives both.
* `model` (ray.data.llm's shape, and an OpenAI Batch line's `"model"`): the base model's name
  (or null) runs the base model; any other name is an adapter under `dynamic_lora_loading_path`.
  Read only when the engine has `enable_lora=True`, so a job that never meant adapters is not
  changed by a `model` column it happens to carry.
A name that does not resolve is a ValueError (the connectors' row error); a directory that does
not load is the engine's (`Engine.check_lora`).
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

LORA_COLUMN = "lora"
MODEL_COLUMN = "model"


@dataclass(frozen=True, slots=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name={self.lora_name!r}: must be a non-empty str")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id={self.lora_int_id!r}: must be an int >= 1")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest.lora_path={self.lora_path!r}: must be a non-empty "
                             "str (a local PEFT adapter directory)")

    def to_dict(self) -> dict[str, Any]:
        return {"lora_name": self.lora_name, "lora_int_id": self.lora_int_id,
                "lora_path": self.lora_path}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LoRARequest":
        return cls(d["lora_name"], d["lora_int_id"], d["lora_path"])


def stable_lora_id(name: str) -> int:
    """An id for an adapter known by name only (a row's `lora` or `model`): the same in every
    process (Python's hash() is salted per process), 31 bits, never 0."""
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") & 0x7FFF_FFFF) or 1


@dataclass(frozen=True)
class AdapterNames:
    """How rows name adapters on one engine (`Engine.lora_names()`)."""

    root: str | None  # dynamic_lora_loading_path
    base_names: frozenset[str]  # what a row's `model` says for the base model

    def request(self, row: Mapping[str, Any],
                value_of: Callable[[Any], Any] = lambda v: v) -> "LoRARequest | None":
        """The adapter `row` names, or None; `value_of` turns a cell into plain Python."""
        value = value_of(row.get(LORA_COLUMN))
        column = LORA_COLUMN
        if value is None:
            value = value_of(row.get(MODEL_COLUMN))
            if value is None or value in self.base_names:
                return None
            column = MODEL_COLUMN
        if isinstance(value, dict):
            return _from_dict(value)
        if not isinstance(value, str) or not value:
            raise ValueError(f"{column} must be an adapter name (a string), got {value!r}")
        if self.root is not None:
            if os.path.isabs(value) or ".." in value.replace("\\", "/").split("/"):
                raise ValueError(f"{column}={value!r}: an adapter name under "
                                 f"dynamic_lora_loading_path, not a path")
            return LoRARequest(value, stable_lora_id(value), os.path.join(self.root, value))
        if column == MODEL_COLUMN:
            raise ValueError(f"model={value!r} is not this engine's model and no "
                             "dynamic_lora_loading_path is set to find it as a LoRA adapter")
        return LoRARequest(value, stable_lora_id(os.path.abspath(value)), value)


def _from_dict(value: dict[str, Any]) -> LoRARequest:
    name, path = value.get("lora_name"), value.get("lora_path")
    if not isinstance(name, str) or not isinstance(path, str):
        raise ValueError(f"lora must give lora_name and lora_path as strings, got {value!r}")
    lid = value.get("lora_int_id")
    return LoRARequest(name, stable_lora_id(name) if lid is None else lid, path)


def no_adapters(row: Mapping[str, Any], value_of: Callable[[Any], Any] = lambda v: v) -> None:
    """A row that names an adapter (its `lora` column) for an engine without enable_lora is
    that row's error."""
    if value_of(row.get(LORA_COLUMN)) is not None:
        raise ValueError("the row names a LoRA adapter (lora column) but the engine was "
                         "started without enable_lora=True")

