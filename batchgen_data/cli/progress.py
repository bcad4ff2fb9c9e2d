"""The command's progress line on stderr: rows done / total, rows/s, output tokens/s, ETA, errors.

On a terminal the line is redrawn in place a few times a second; piped (a log file, CI) a
full line is printed every `interval_s`, so a log stays readable. The last line is always
printed when the run ends.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import IO


class Progress:
    def __init__(self, total: int, already_done: int = 0, stream: IO[str] | None = None,
                 interval_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.done = already_done  # rows answered by an earlier run (--resume)
        self.skipped = already_done
        self.errors = 0
        self.tokens = 0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval_s = interval_s if interval_s is not None else (0.25 if self.tty else 10.0)
        self._clock = clock
        self._start = clock()
        self._last = float("-inf")

    def update(self, error: bool, tokens: int = 0) -> None:
        self.done += 1
        self.errors += error
        self.tokens += tokens
        now = self._clock()
        if now - self._last >= self.interval_s:
            self._last = now
            self._show(now)

    def line(self, now: float | None = None) -> str:
        now = self._clock() if now is None else now
        elapsed = max(now - self._start, 1e-9)
        ran = self.done - self.skipped  # rates count this run's rows only
        rate = ran / elapsed
        left = self.total - self.done
        eta = f"{_clock_text(left / rate)}" if rate > 0 and left else ("0s" if not left else "?")
        return (f"[batchgen] {self.done}/{self.total} rows | {rate:.2f} rows/s | "
                f"{self.tokens / elapsed:.1f} out tok/s | ETA {eta} | errors {self.errors}")

    def _show(self, now: float) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K" + self.line(now))
        else:
            self.stream.write(self.line(now) + "\n")
        self.stream.flush()

    def close(self) -> None:
        self._show(self._clock())
        if self.tty:
            self.stream.write("\n")
        self.stream.flush()


def _clock_text(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
