"""Where a row's image comes from, read into memory: bytes, a decoded array, or a PIL image.

A source is what a front door hands over: an OpenAI `image_url` (a `data:` URL, `http(s)://`,
`file://`, any fsspec URL such as `s3://` or `memory://`, or a local path), the bytes of an
image column, a `{"bytes": ..., "path": ...}` struct (Hugging Face datasets), Spark's
`binaryFile` row (`{"content": ..., "path": ...}`) or `image` source struct, the HWC uint8
arrays `ray.data.read_images` yields, or a PIL image. `Fetcher` reads URLs on a bounded pool of
threads, each under one deadline for the whole read; whatever goes wrong is a ValueError whose
message is the row's error.

A local path or `file://` URL is a read of the worker's own disk: refused unless the options'
`allowed_local_media_path` names a directory and the path, once its links and `..` are
resolved, lies below it (vLLM's rule), so a batch file or table from elsewhere cannot read the
worker's files. The resolved path is what is opened. An fsspec URL that reaches the local disk
(`local://`, a chain over a bare path or `file://` such as `zip://a.png::/data/x.zip`, `git://`)
is refused outright. Bytes, arrays, PIL images and structs holding bytes are not file reads.
"""
from __future__ import annotations

import base64
import binascii
import os
import re
import time
import urllib.parse
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np

from batchgen_data.inputs.image_options import ImageOptions
from batchgen_data.inputs.prompt_checks import shown

_CHUNK = 1 << 16
_SPARK_IMAGE_FIELDS = frozenset({"origin", "height", "width", "nChannels", "mode", "data"})
# fsspec filesystems over the worker's own disk (a local repository for git and dvc; generic
# takes any other URL as its path)
_LOCAL_PROTOCOLS = frozenset({"file", "local", "asynclocal", "git", "dvc", "generic"})
_NOT_ALLOWED = ("local image files are read only below allowed_local_media_path (vLLM's "
                "engine argument; --allowed-local-media-path in the command), which is unset")


def describe(source: Any) -> str:
    """A source as a message names it: a URL or path cut short, else its type."""
    if isinstance(source, str):
        return shown(source[:40] + "..." if source.startswith("data:") else source)
    return type(source).__name__


def _data_url(url: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep:
        raise ValueError("data: URL without a ',' before its payload")
    if not head.endswith(";base64"):
        raise ValueError("data: URL must be base64 (data:image/png;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("data: URL payload is not valid base64") from None


def spark_image(struct: dict[str, Any]) -> np.ndarray:
    """Spark's `image` source row (OpenCV layout: BGR(A) uint8, row-major) as an RGB(A) array."""
    h, w, c = struct["height"], struct["width"], struct["nChannels"]
    data = struct["data"]
    if c not in (1, 3, 4) or not isinstance(data, (bytes, bytearray)) or len(data) != h * w * c:
        raise ValueError(f"Spark image struct: {h}x{w}x{c} does not match its {len(data or b'')}"
                         " data bytes (8-bit images only)")
    arr = np.frombuffer(data, dtype=np.uint8).reshape(h, w, c)
    if c == 1:
        return arr[:, :, 0]
    return arr[:, :, [2, 1, 0, 3][:c]]  # BGR(A) -> RGB(A)


def _local_protocol(url: str) -> str | None:
    """The protocol by which an fsspec URL (chains joined by "::" included) reads the local
    disk, or None. Segments are read as fsspec reads them: a bare lowercase word is a protocol
    name, anything else without "://" (or a one-letter drive) a local path."""
    for seg in url.split("::"):
        if "://" in seg:
            proto = seg.split("://", 1)[0].lower()
        elif re.fullmatch("[a-z]+", seg):
            proto = seg
        else:
            return "a local path"
        if proto in _LOCAL_PROTOCOLS or len(proto) == 1:
            return proto
    return None


class Fetcher:
    """Reads sources into memory; URLs on at most `image_fetch_concurrency` threads."""

    def __init__(self, options: ImageOptions) -> None:
        self.options = options
        self._pool = ThreadPoolExecutor(options.image_fetch_concurrency,
                                        thread_name_prefix="image-fetch")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def start(self, source: Any) -> Future | Any:
        """A Future of the bytes for a URL to fetch; anything in memory already, as it is."""
        if isinstance(source, dict):
            source = self._from_struct(source)
        if isinstance(source, str) and not source.startswith("data:"):
            return self._pool.submit(self._read_url, self._checked(source))
        return source

    def result(self, started: Future | Any, source: Any) -> Any:
        """What `start` began, within the fetch timeout: bytes, an array or a PIL image."""
        if not isinstance(started, Future):
            if isinstance(started, str):
                return _data_url(started)
            if isinstance(started, (bytearray, memoryview)):
                return bytes(started)
            return started
        try:
            return started.result(timeout=self.options.image_fetch_timeout_s)
        except FutureTimeout:
            started.cancel()
            raise ValueError(f"could not fetch {describe(source)}: timed out after "
                             f"{self.options.image_fetch_timeout_s:g}s "
                             "(image_fetch_timeout_s)") from None

    def _from_struct(self, struct: dict[str, Any]) -> Any:
        struct = {k: v for k, v in struct.items() if v is not None}
        if _SPARK_IMAGE_FIELDS <= set(struct):
            return spark_image(struct)
        for key in ("bytes", "content", "data"):  # HF datasets, Spark binaryFile, others
            if isinstance(struct.get(key), (bytes, bytearray, memoryview)):
                return bytes(struct[key])
        for key in ("url", "path"):
            if isinstance(struct.get(key), str):
                return struct[key]
        raise ValueError(f"image struct has none of bytes / content / url / path: "
                         f"{shown(sorted(struct))}")

    def _checked(self, url: str) -> str:
        """What to read for `url`: a local path or `file://` URL as its resolved path below
        `allowed_local_media_path`; ValueError for any other read of the local disk."""
        if url.startswith(("http://", "https://")):
            return url
        if "://" not in url:  # a plain path (opened as one, "::" included)
            return self._inside(url)
        if url[:7].lower() == "file://":
            parts = urllib.parse.urlsplit(url)
            return self._inside(urllib.request.url2pathname(parts.netloc + parts.path))
        proto = _local_protocol(url)
        if proto is not None:
            raise ValueError(f"{describe(url)} reads the worker's local disk through fsspec "
                             f"({proto}); a local image is read only as a path or file:// URL "
                             "below allowed_local_media_path")
        return url

    def _inside(self, path: str) -> str:
        root = self.options.allowed_local_media_path
        if root is None:
            raise ValueError(_NOT_ALLOWED)
        resolved = os.path.realpath(path)
        if os.path.commonpath([root, resolved]) != root or resolved == root:
            raise ValueError(f"{describe(path)} is not below allowed_local_media_path {root!r} "
                             "once its links and '..' are resolved")
        return resolved

    def _read_url(self, url: str) -> bytes:
        deadline = time.monotonic() + self.options.image_fetch_timeout_s
        try:
            if url.startswith(("http://", "https://")):
                return self._read_http(url, deadline)
            return self._read_fsspec(url)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure to read is this row's error
            raise ValueError(f"could not fetch {describe(url)}: "
                             f"{type(e).__name__}: {e}") from None

    def _read_http(self, url: str, deadline: float) -> bytes:
        """The body read in chunks under one deadline, so a server that trickles bytes stops
        at the timeout too (a socket timeout alone bounds each read, not the whole)."""
        parts, size = [], 0
        left = max(deadline - time.monotonic(), 0.001)
        with urllib.request.urlopen(url, timeout=left) as resp:  # noqa: S310 - the row's URL
            while True:
                if time.monotonic() > deadline:
                    raise TimeoutError("the read passed its deadline")
                chunk = resp.read(_CHUNK)
                if not chunk:
                    return b"".join(parts)
                size += len(chunk)
                self._check_size(size, url)
                parts.append(chunk)

    def _read_fsspec(self, url: str) -> bytes:
        if "://" not in url:  # a path `_checked` resolved
            with open(url, "rb") as f:
                data = f.read(self.options.max_image_bytes + 1)
        else:
            import fsspec

            with fsspec.open(url, "rb") as f:
                data = f.read(self.options.max_image_bytes + 1)
        self._check_size(len(data), url)
        return data

    def _check_size(self, size: int, url: str) -> None:
        if size > self.options.max_image_bytes:
            raise ValueError(f"image at {describe(url)} is over max_image_bytes="
                             f"{self.options.max_image_bytes}")
