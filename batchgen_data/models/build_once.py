"""A cache directory built once per node, whoever asks for it first.

Executors and actors of one node often start together and ask for the same directory (the
default model's conversion, a model copied from a URL). `build_once` takes an exclusive `flock`
on `<target>.lock` next to it, checks again under the lock (the process it waited for may have
built it), removes what crashed builders left (their `.<name>.tmp-*` folders, a stale target),
fills a fresh temp folder and renames it into place: readers see nothing or everything.
"""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


def build_once(target: Path, is_complete: Callable[[Path], bool], fill: Callable[[Path], None],
               unwritable: Callable[[OSError], Exception]) -> bool:
    """Build `target` with `fill(tmp_dir)` unless `is_complete(target)`; True when this call
    built it. `unwritable(err)` is the error raised when the cache folder cannot be written."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = open(target.with_name(target.name + ".lock"), "a")
    except OSError as err:
        raise unwritable(err) from err
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # blocks while another process of the node builds it
        try:
            if is_complete(target):  # built by the process we waited for
                return False
            _remove_leftovers(target)
            # Not mkdtemp: its 0700 mode would make a shared cache unreadable to other users.
            tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            tmp.mkdir()
            try:
                fill(tmp)
                os.rename(tmp, target)  # atomic: readers see nothing or everything
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return True


def _remove_leftovers(target: Path) -> None:
    """Drop crashed builders' temp folders and a stale or half-built target (we hold the lock)."""
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if target.exists():
        log.warning("cache %s is incomplete or out of date: building it again", target)
        shutil.rmtree(target)
