"""`LoRARequest`: which adapter a prompt runs under, in vLLM's shape.

`LoRARequest(lora_name, lora_int_id, lora_path)`: `lora_path` is a local PEFT directory
(`adapter_config.json` + `adapter_model.safetensors`); `lora_int_id` (>= 1) is the adapter's
identity inside an engine: its device slot, its host copy and its prefix-cache key. Connectors
derive the id from the name (`stable_lora_id`), so the same adapter has the same id on every
worker and a row moved between engines keeps it. Plain data: it travels with an exported row.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any


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
