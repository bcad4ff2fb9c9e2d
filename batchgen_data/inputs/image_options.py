"""How a front door prepares a row's images: limits, fetching and the worker pool's size.

Given with the engine's keyword arguments (`LLM(model, limit_mm_per_prompt={"image": 2})`, a
connector's `engine_kwargs`, the command's `--engine-arg`s) and taken out of them before the
engine is built (`ImageOptions.pop_from`): they are the inputs pipeline's settings, not the
engine's. vLLM's names where vLLM has one (`limit_mm_per_prompt`, `mm_processor_kwargs`,
`allowed_local_media_path`).
"""
from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field, fields
from typing import Any

# the image formats PIL decodes that a row may carry; others (EPS runs Ghostscript, PSD, ...)
# are refused by name, so no decoder outside this list ever sees a row's bytes
FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
_VLLM_DEFAULT_LIMIT = 999  # vLLM's per-modality default when limit_mm_per_prompt is unset


@dataclass(frozen=True)
class ImageOptions:
    # vLLM's: the most items of each modality one prompt may hold ({"image": 4})
    limit_mm_per_prompt: Mapping[str, int] = field(default_factory=dict)
    # vLLM's: keyword arguments of the HF processor's call (e.g. {"max_pixels": 401408})
    mm_processor_kwargs: Mapping[str, Any] = field(default_factory=dict)
    image_fetch_timeout_s: float = 10.0  # one URL's whole fetch, connection to last byte
    image_fetch_concurrency: int = 8  # URLs fetched at once by one front door
    image_workers: int = 2  # threads that decode, resize and normalise (PIL frees the GIL)
    # a decompression bomb is refused from its header, before its pixels are decoded
    max_image_pixels: int = 64 * 1024 * 1024
    max_image_bytes: int = 64 << 20  # an encoded image (a fetched URL stops reading past it)
    # vLLM's: the one directory whose files a row may name by path or file:// URL; unset, no
    # local file is read, so an untrusted batch file or table cannot read the worker's files
    allowed_local_media_path: str | None = None

    def __post_init__(self) -> None:
        limits = self.limit_mm_per_prompt
        if limits is None:
            object.__setattr__(self, "limit_mm_per_prompt", {})
        elif not isinstance(limits, Mapping) or not all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
                for k, v in limits.items()):
            raise ValueError(f"limit_mm_per_prompt must map a modality to an int >= 0, e.g. "
                             f"{{'image': 4}}, got {limits!r}")
        unknown = sorted(set(self.limit_mm_per_prompt) - {"image"})
        if any(self.limit_mm_per_prompt[k] for k in unknown):
            raise ValueError(f"limit_mm_per_prompt: {unknown} are not supported (images only)")
        if self.mm_processor_kwargs is None:
            object.__setattr__(self, "mm_processor_kwargs", {})
        elif not isinstance(self.mm_processor_kwargs, Mapping):
            raise ValueError(f"mm_processor_kwargs must be a dict, got "
                             f"{self.mm_processor_kwargs!r}")
        object.__setattr__(self, "allowed_local_media_path",
                           _media_dir(self.allowed_local_media_path))
        for name in ("image_fetch_timeout_s",):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a number > 0, got {v!r}")
        for name in ("image_fetch_concurrency", "image_workers", "max_image_pixels",
                     "max_image_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")

    @property
    def image_limit(self) -> int:
        return int(self.limit_mm_per_prompt.get("image", _VLLM_DEFAULT_LIMIT))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def pop_from(cls, kwargs: MutableMapping[str, Any]) -> "ImageOptions":
        """The options among `kwargs` (removed from it), the defaults for the others."""
        return cls(**{n: kwargs.pop(n) for n in cls.names() if n in kwargs})

    @classmethod
    def of(cls, kwargs: Mapping[str, Any] | None) -> "ImageOptions":
        """The options among `kwargs`, which is left as it is."""
        kwargs = kwargs or {}
        return cls(**{n: kwargs[n] for n in cls.names() if n in kwargs})


def _media_dir(path: object) -> str | None:
    """`allowed_local_media_path` resolved (symlinks and `..` followed once, here), checked to
    be a directory as vLLM checks it; None and "" (vLLM's default) leave local files unread."""
    if path is None or path == "":
        return None
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"allowed_local_media_path must be a directory path, got {path!r}")
    resolved = os.path.realpath(os.fspath(path))
    if not os.path.isdir(resolved):
        raise ValueError(f"allowed_local_media_path {os.fspath(path)!r} is not a directory "
                         "(it must exist on the machine that reads the images)")
    return resolved
