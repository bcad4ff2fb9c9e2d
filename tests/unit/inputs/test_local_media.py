"""`allowed_local_media_path` (vLLM's engine argument): a row's local path or `file://` URL is
read only below that directory, once its links and `..` are resolved; unset, no local file is
read. Sources held in memory (bytes, arrays, `data:` and `memory://` URLs) are not file reads
and read either way. The oracle is the file's own bytes, written by the test."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest

from batchgen_data.inputs.image_fetch import Fetcher
from batchgen_data.inputs.image_options import ImageOptions

PNG = b"\x89PNG\r\n\x1a\n not decoded here"  # the fetcher reads bytes; it never decodes


def read(source: Any, allowed: Path | str | None) -> Any:
    fetcher = Fetcher(ImageOptions(allowed_local_media_path=allowed))
    try:
        return fetcher.result(fetcher.start(source), source)
    finally:
        fetcher.close()


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    """allowed/ with a picture, a link out and a subfolder; secret.png beside allowed/."""
    allowed, secret = tmp_path / "allowed", tmp_path / "secret.png"
    (allowed / "sub").mkdir(parents=True)
    (allowed / "sub" / "in.png").write_bytes(PNG)
    secret.write_bytes(b"the worker's secret")
    (allowed / "link.png").symlink_to(secret)
    (allowed / "inner_link.png").symlink_to(allowed / "sub" / "in.png")
    return {"allowed": allowed, "secret": secret}


def test_unset_reads_no_local_file(tree: dict[str, Path]) -> None:
    inside = tree["allowed"] / "sub" / "in.png"
    for source in (str(inside), f"file://{inside}", {"path": str(inside)},
                   {"url": f"file://{inside}"}, "sub/in.png"):
        with pytest.raises(ValueError, match="allowed_local_media_path.*unset"):
            read(source, None)
    with pytest.raises(ValueError, match="unset"):
        read(str(inside), "")  # vLLM's default, ""


def test_inside_is_read(tree: dict[str, Path]) -> None:
    allowed = tree["allowed"]
    inside = allowed / "sub" / "in.png"
    for source in (str(inside), f"file://{inside}", f"file://{allowed}/sub/../sub/in.png",
                   str(allowed / "inner_link.png"), {"path": str(inside)}):
        assert read(source, allowed) == PNG, source


@pytest.mark.parametrize("escape", [
    "{secret}",  # a path outside
    "file://{secret}",
    "{allowed}/link.png",  # a link inside to a file outside
    "file://{allowed}/link.png",
    "{allowed}/../secret.png",  # `..` out of the directory
    "{allowed}/sub/../../secret.png",
    "file://{allowed}/sub/%2E%2E/%2E%2E/secret.png",  # `..` percent-encoded in a URL
    "{allowed}",  # the directory itself is no file below it
])
def test_escapes_are_refused(tree: dict[str, Path], escape: str) -> None:
    source = escape.format(**tree)
    with pytest.raises(ValueError, match="not below allowed_local_media_path"):
        read(source, tree["allowed"])


def test_the_allowed_directory_is_resolved(tree: dict[str, Path], tmp_path: Path) -> None:
    """A link to the directory is the directory; a sibling whose name starts the same is not."""
    (tmp_path / "to_allowed").symlink_to(tree["allowed"])
    (tmp_path / "allowed2").mkdir()
    (tmp_path / "allowed2" / "x.png").write_bytes(PNG)
    assert read(str(tree["allowed"] / "sub" / "in.png"), tmp_path / "to_allowed") == PNG
    with pytest.raises(ValueError, match="not below"):
        read(str(tmp_path / "allowed2" / "x.png"), tree["allowed"])


@pytest.mark.parametrize("url", [
    "local://{allowed}/sub/in.png",
    "simplecache::file://{allowed}/sub/in.png",
    "zip://in.png::{allowed}/sub/in.png",
    "dir://../../secret.png::file://{allowed}/sub",
    "FILE://{secret}",
])
def test_fsspec_urls_over_the_local_disk_are_refused(tree: dict[str, Path], url: str) -> None:
    with pytest.raises(ValueError, match="local|not below"):
        read(url.format(**tree), tree["allowed"])


def test_sources_in_memory_need_no_allowance(tree: dict[str, Path]) -> None:
    with fsspec.open("memory://media/in.png", "wb") as f:
        f.write(PNG)
    arr = np.zeros((2, 2, 3), np.uint8)
    assert read("memory://media/in.png", None) == PNG
    assert read(PNG, None) == PNG
    assert read({"bytes": PNG, "path": str(tree["secret"])}, None) == PNG  # bytes win
    assert read("data:image/png;base64,iVBORw==", None) == b"\x89PNG"
    assert read(arr, None) is arr


def test_a_missing_file_inside_is_a_fetch_error(tree: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="could not fetch.*FileNotFoundError"):
        read(str(tree["allowed"] / "nope.png"), tree["allowed"])


def test_the_option_is_checked(tree: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="is not a directory"):
        ImageOptions(allowed_local_media_path=str(tree["secret"]))
    with pytest.raises(ValueError, match="is not a directory"):
        ImageOptions(allowed_local_media_path=str(tree["allowed"] / "missing"))
    with pytest.raises(ValueError, match="must be a directory path"):
        ImageOptions(allowed_local_media_path=3)  # type: ignore[arg-type]
    opts = ImageOptions.of({"allowed_local_media_path": tree["allowed"] / "sub" / ".."})
    assert opts.allowed_local_media_path == os.path.realpath(tree["allowed"])
    assert ImageOptions().allowed_local_media_path is None
