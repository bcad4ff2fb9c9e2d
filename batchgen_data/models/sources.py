"""Model sources a cluster can read: `model="file:///shared/models/x"`, `s3://bucket/x`,
`gs://...`, `abfss://...`, `memory://...` or any other fsspec URL (chained ones such as
`simplecache::s3://...` too).

Executors cannot load weights from the driver's disk, and reading safetensors straight from an
object store on every engine build is slow, so a URL is copied once per node into a local cache
(`env.model_cache_dir()`: `$BATCHGEN_MODEL_CACHE_DIR`, else `<cache dir>/models`) and then
loaded as an ordinary local HF directory.

Several executors of one node usually start together: the copy runs under an exclusive `flock`
(the others wait, then find the finished copy) into a temp folder that is renamed into place,
with a manifest of every file and its size written last. A cache folder whose files do not match
its manifest (a truncated file, a copy killed by an older writer, a file deleted by hand), or
whose manifest no longer matches the source's listing (the model at the URL was replaced), is
removed and copied again. The source is listed on every call (one `find`); when it cannot be
listed (the store is unreachable) a complete cached copy is used as it is.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchgen_data import env
from batchgen_data.models.build_once import build_once

log = logging.getLogger(__name__)

MANIFEST = ".batchgen_source.json"
_CHUNK = 8 << 20
_SKIPPED_DIRS = (".git",)  # a cloned hub repository's history is not part of the model


@dataclass(frozen=True)
class Fetched:
    path: Path  # the local model directory
    copied: bool  # True when this call did the copy (False: the cache already had it)


def is_url(model: str | os.PathLike[str] | None) -> bool:
    """A model string that names a filesystem URL rather than a local path or a hub id."""
    return isinstance(model, str) and "://" in model


def local_copy(url: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The local directory holding the model at `url`, copied there on first use."""
    return fetch(url, cache_dir).path


def cache_path(url: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where `url` is (or will be) cached: `<cache>/<last path part>-<hash of the URL>`; the
    lock file sits next to it (`<that>.lock`)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else env.model_cache_dir()
    norm = url.rstrip("/")
    name = re.sub(r"[^A-Za-z0-9._-]", "_", posixpath.basename(norm.split("::")[-1]))[:64]
    digest = hashlib.sha256(norm.encode()).hexdigest()[:16]
    return root / f"{name or 'model'}-{digest}"


def fetch(url: str, cache_dir: str | os.PathLike[str] | None = None) -> Fetched:
    """Copy the model at `url` into the node's cache unless a complete copy is there."""
    target = cache_path(url, cache_dir)
    try:
        fs, root = _filesystem(url)
        listing = _list_files(fs, root)
        if not listing:  # fsspec lists a missing folder as empty
            raise FileNotFoundError("no files there")
    except Exception as err:  # unreachable source: a complete cache still serves
        if _matches(target, None):
            log.warning("model=%r: cannot list the source (%s); using the cached copy at %s",
                        url, err, target)
            return Fetched(target, False)
        raise ValueError(f"model={url!r}: cannot read the model's files ({err})") from err
    if "config.json" not in listing:
        raise ValueError(f"model={url!r}: no config.json there (found {sorted(listing)[:8]})")
    if _matches(target, listing):
        return Fetched(target, False)
    def fill(tmp: Path) -> None:
        log.info("model=%r: copying %d files (%.1f MiB) into %s", url, len(listing),
                 sum(s or 0 for s in listing.values()) / 2**20, target)
        sizes = _copy(fs, root, listing, tmp)
        (tmp / MANIFEST).write_text(json.dumps({"url": url, "files": sizes}, sort_keys=True))

    def unwritable(err: OSError) -> Exception:
        return RuntimeError(f"model={url!r}: cannot write the model cache in {target.parent} "
                            f"({err}); point $BATCHGEN_MODEL_CACHE_DIR at a writable local "
                            "directory")

    copied = build_once(target, lambda t: _matches(t, listing), fill, unwritable)
    return Fetched(target, copied)


def _filesystem(url: str) -> tuple[Any, str]:
    try:
        import fsspec
    except ImportError as err:  # torch depends on fsspec, so this is rare
        raise RuntimeError(f"model={url!r}: URL models need fsspec (pip install fsspec, plus "
                           "the filesystem's package such as s3fs or gcsfs)") from err
    fs, root = fsspec.core.url_to_fs(url)
    return fs, root.rstrip("/")


def _list_files(fs: Any, root: str) -> dict[str, int | None]:
    """Relative POSIX path -> size (None when the filesystem does not say) of every file."""
    found = fs.find(root, detail=True)
    prefix = root + "/"
    listing: dict[str, int | None] = {}
    for path, info in found.items():
        if info.get("type", "file") != "file":
            continue
        path = fs._strip_protocol(path).rstrip("/")
        if not path.startswith(prefix):
            continue
        rel = path[len(prefix):]
        if rel == MANIFEST or rel.split("/")[0] in _SKIPPED_DIRS:
            continue
        size = info.get("size")
        listing[rel] = int(size) if size is not None else None
    return listing


def _copy(fs: Any, root: str, listing: dict[str, int | None], dest: Path) -> dict[str, int]:
    sizes = {}
    for rel, expected in sorted(listing.items()):
        out = dest.joinpath(*rel.split("/"))
        out.parent.mkdir(parents=True, exist_ok=True)
        with fs.open(f"{root}/{rel}", "rb") as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, _CHUNK)
        size = out.stat().st_size
        if expected is not None and size != expected:
            raise OSError(f"{root}/{rel}: copied {size} bytes, the source lists {expected}")
        sizes[rel] = size
    return sizes


def _manifest(target: Path) -> dict[str, int] | None:
    try:
        files = json.loads((target / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return files if isinstance(files, dict) else None


def _matches(target: Path, listing: dict[str, int | None] | None) -> bool:
    """The cache holds every manifest file at its size and, given the source's listing, the same
    files (with the same sizes where the source gives them)."""
    files = _manifest(target)
    if files is None:
        return False
    if listing is not None:
        if set(files) != set(listing):
            return False
        if any(size is not None and files[rel] != size for rel, size in listing.items()):
            return False
    for rel, size in files.items():
        try:
            if target.joinpath(*rel.split("/")).stat().st_size != size:
                return False
        except OSError:
            return False
    return True
