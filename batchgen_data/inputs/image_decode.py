"""Bytes, arrays and PIL images to one checked RGB picture and its content hash.

Every check that makes a bad image a row error rather than a crash or a stall sits here:
formats outside `image_options.FORMATS` are refused by name (PIL never tries another decoder on
a row's bytes), an image over `max_image_pixels` is refused from its header before its pixels
are decoded (a decompression bomb costs nothing), and corrupt or truncated data is named so.
"""
from __future__ import annotations

import hashlib
import io
import warnings
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from batchgen_data.inputs.image_options import FORMATS, ImageOptions


def _check_pixels(width: int, height: int, options: ImageOptions) -> None:
    if width < 1 or height < 1:
        raise ValueError(f"image is {width}x{height}: empty")
    if width * height > options.max_image_pixels:
        raise ValueError(f"image is {width}x{height} = {width * height} pixels, over "
                         f"max_image_pixels={options.max_image_pixels} (a decompression bomb "
                         "is refused from its header)")


def _from_bytes(data: bytes, options: ImageOptions) -> Image.Image:
    if len(data) > options.max_image_bytes:
        raise ValueError(f"image has {len(data)} bytes, over max_image_bytes="
                         f"{options.max_image_bytes}")
    if not data:
        raise ValueError("image data is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise ValueError(f"image data is not an image in a supported format ({', '.join(FORMATS)}"
                         f"; starts {data[:8]!r})") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ValueError(f"image is over the pixel cap: {e}") from None
    except Exception as e:  # noqa: BLE001 - a header PIL cannot parse
        raise ValueError(f"corrupt image data: {type(e).__name__}: {e}") from None
    _check_pixels(img.width, img.height, options)
    try:
        img.seek(0)  # an animation's first frame
        img.load()
    except Exception as e:  # noqa: BLE001 - OSError "image file is truncated", SyntaxError, ...
        raise ValueError(f"corrupt or truncated {img.format} image data: "
                         f"{type(e).__name__}: {e}") from None
    return img


def _from_array(arr: np.ndarray, options: ImageOptions) -> Image.Image:
    if arr.dtype != np.uint8:
        raise ValueError(f"image array must be uint8, got {arr.dtype}")
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[:, :, 0]
    if not (arr.ndim == 2 or (arr.ndim == 3 and arr.shape[2] in (3, 4))):
        raise ValueError(f"image array must be HxW or HxWxC (C 1, 3 or 4), got shape "
                         f"{tuple(arr.shape)}")
    _check_pixels(arr.shape[1], arr.shape[0], options)
    return Image.fromarray(np.ascontiguousarray(arr))


def decode(source: Any, options: ImageOptions) -> Image.Image:
    """An RGB PIL image from fetched bytes, an array or a PIL image; ValueError naming what is
    wrong."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        img = _from_bytes(bytes(source), options)
    elif isinstance(source, np.ndarray):
        img = _from_array(source, options)
    elif isinstance(source, Image.Image):
        _check_pixels(source.width, source.height, options)
        img = source
    elif isinstance(source, list):  # an array that Arrow turned into nested lists
        img = _from_array(np.asarray(source, dtype=np.uint8), options)
    else:
        raise TypeError(f"an image must be a URL, a path, bytes, an array or a PIL image, got "
                        f"{type(source).__name__}")
    if img.mode != "RGB":
        img = _to_rgb(img)
    return img


def _to_rgb(img: Image.Image) -> Image.Image:
    """Transparency over white (what a viewer shows), as vLLM converts RGBA."""
    if img.mode in ("RGBA", "LA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def pixel_hash(img: Image.Image, salt: str = "") -> str:
    """The image's identity: its decoded pixels (and `salt`, the processor's settings), so the
    same picture sent as PNG in one row and as an array in another is one cache entry."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{salt}|{img.mode}|{img.width}x{img.height}|".encode())
    h.update(img.tobytes())
    return h.hexdigest()
