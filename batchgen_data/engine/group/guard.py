"""An engine group's watch over its other processes (engine/group/group.py).

Every wait of rank 0 on another process is bounded (`collective_timeout_s`): `Guard.call` runs
one such step, and any failure to reach another process makes the group dead, with the rank
and the end of its log when a process is gone, now and on every later call (`check`). A
tensor-parallel engine's own `EngineDeadError` passes through as it is.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from batchgen_data.core.errors import EngineDeadError
from batchgen_data.layers.parallel import CollectiveError
from batchgen_data.worker.tp.launch import RankGroup


class Guard:
    def __init__(self, ranks: RankGroup) -> None:
        self.ranks = ranks
        self.dead: str | None = None  # why the group is dead, once it is

    def check(self) -> None:
        """`EngineDeadError` once the group is dead or closed."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)`, any failure to reach another process making the group dead."""
        try:
            return fn(*args)
        except EngineDeadError as exc:  # a TP engine's own report
            self.dead = str(exc)
            self.ranks.close()
            raise
        except Exception as exc:
            deadline = time.monotonic() + 1.0  # a process that just died: let its exit show
            while self.ranks.dead() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            why = self.ranks.dead() or ("a rank stalled" if isinstance(exc, CollectiveError)
                                        else type(exc).__name__)
            self.dead = f"engine group is dead ({why}): {exc}"
            self.ranks.close()
            raise EngineDeadError(self.dead) from exc
