"""The command's own files kept safe: never the input, one run per output, no links followed.

Three ways a batch job can destroy data before it has run a single request, and what stops each:

* `-o` naming the input (the same path, a symbolic link to it, or a hard link: the same device
  and inode) would truncate the input before it is read: `refuse_input_as_output` stops the
  run before anything is opened for writing;
* two runs writing one output interleave their lines: each run holds an exclusive lock on
  `OUTPUT.lock` (`OutputLock`, `flock`), and a second run fails at once naming the first;
* the files the command makes beside the output (the table's `OUTPUT.partial.jsonl` resume
  state, the lock, the report) are opened with `O_NOFOLLOW`, so a link planted at one of those
  names is refused rather than followed to some other file.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import IO, Any

_WRITE_FLAGS = {"w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                "r": os.O_RDONLY, "r+": os.O_RDWR}


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file (links followed): same device and inode."""
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def refuse_input_as_output(input_path: Path, written: dict[str, Path]) -> None:
    """ValueError when a file the run writes (`written`: flag -> path) is the input file."""
    for flag, path in written.items():
        if same_file(path, input_path):
            raise ValueError(f"{flag} {str(path)!r} is the input file {str(input_path)!r} (or a "
                             "link to it): writing it would destroy the input; choose another "
                             f"{flag}")


def open_nofollow(path: Path, mode: str = "w") -> IO[str]:
    """`path` opened as text without following a link at its last component."""
    flags = _WRITE_FLAGS[mode] | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if os.path.islink(path):
            raise ValueError(f"{str(path)!r} is a symbolic link; the command writes its own "
                             "files beside the output and does not follow links there") from e
        raise
    return os.fdopen(fd, mode, encoding="utf-8")


def write_text_nofollow(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open_nofollow(path, "w") as f:
        f.write(text)


def replace_lines(path: Path, lines: list[str]) -> None:
    """Rewrite `path` as `lines` in one step: a new file beside it, synced, renamed over it (a
    link named by the user is kept: the file it points to is the one replaced)."""
    target = Path(os.path.realpath(path))
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(t + "\n" for t in lines)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, os.stat(target).st_mode & 0o7777)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class OutputLocked(ValueError):
    """Another run holds the output's lock."""


class OutputLock:
    """An exclusive `flock` on `OUTPUT.lock` for the whole run.

    The lock file names its holder (pid, host, start time, command) so a second run can say
    who it is waiting for; the kernel drops the lock when the holder exits, however it exits,
    so a killed run never blocks the `--resume` after it. The holder deletes the file while
    still holding the lock; a run that opened the file just before that deletion finds the
    name no longer points at its file and starts over, so two runs never hold different files.
    """

    def __init__(self, output: Path) -> None:
        self.path = output.with_name(output.name + ".lock")
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(10):
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise OutputLocked(
                    f"{str(self.path)[:-len('.lock')]!r} is being written by another "
                    f"batchgen-data run ({holder}); its lock is {str(self.path)!r}. Wait for "
                    "that run to end, or write to another -o") from None
            if self._still_named(fd):
                os.ftruncate(fd, 0)
                os.write(fd, json.dumps(_holder_info()).encode() + b"\n")
                self._fd = fd
                return
            os.close(fd)  # its holder deleted it after we opened it: take the new one
        raise OutputLocked(f"could not take the lock {str(self.path)!r}: it keeps changing")

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                           0o644)
        except OSError as e:
            if os.path.islink(self.path):
                raise ValueError(f"{str(self.path)!r} is a symbolic link; refusing to follow "
                                 "it") from e
            raise

    def _still_named(self, fd: int) -> bool:
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        own = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _holder_info() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode("utf-8", errors="replace"))
        return (f"pid {info['pid']} on {info['host']}, started {info['started']}: "
                f"{info['command']}")
    except (ValueError, KeyError, TypeError, OSError):
        return "holder unknown"
