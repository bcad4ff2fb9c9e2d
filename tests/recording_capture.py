"""A capture seam for piecewise CUDA graphs that behaves like a CUDA graph on the CPU
(`worker/fast_paths/piecewise_graphs.PieceCapture`): `RecordingPieces` records every aten op a
piece runs and replays exactly those ops on the same tensors, so a replay sees new data only
through the tensors the piece read, any host value a piece read stays frozen at capture, and a
piece that reads a device value on the host fails at capture, as it would on a GPU. Ops that do
not go through torch's dispatcher (the C kernels, Triton's interpreter) are not seen: build the
model with `cpu_kernels=False`."""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten
# ops whose result a CUDA graph cannot hold: a value read back to the host, or an output whose
# shape depends on the data
_HOST_READS = {aten._local_scalar_dense.default, aten.nonzero.default,
               aten.masked_select.default, aten.equal.default, aten.is_nonzero.default}


def _storages(tree: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tree_leaves(tree)
            if isinstance(t, torch.Tensor)}


class _Recorder(TorchDispatchMode):
    """Records each op with how a replay redoes it: "mutate" (runs again on the same tensors),
    "view" (skipped: its output is memory of its inputs, which the replay refreshes) or
    "compute" (runs again, its result copied into the recorded output). An op whose schema
    only says its output may alias (`reshape`, `to`) is a view only if it did alias here."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, Any, tuple, dict, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in _HOST_READS:
            raise RuntimeError(f"{func} inside a captured piece: a host read of a device value")
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            kind = "mutate"
        elif _storages(out) and _storages(out) <= _storages((args, kwargs)):
            kind = "view"
        else:
            kind = "compute"
        self.ops.append((kind, func, args, kwargs, out))
        return out


def _replay(ops: list[tuple[str, Any, tuple, dict, Any]]) -> None:
    for kind, func, args, kwargs, out in ops:
        if kind == "mutate":
            func(*args, **kwargs)
        elif kind == "compute":
            fresh = func(*args, **kwargs)
            for dst, src in zip(tree_leaves(out), tree_leaves(fresh)):
                if isinstance(dst, torch.Tensor):
                    dst.copy_(src)


class RecordingPieces:
    """`PieceCapture` for the CPU: a piece is the list of ops it ran; replay runs them again."""

    def __init__(self) -> None:
        self._rec: _Recorder | None = None
        self.replays = 0

    def scope(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def begin(self) -> None:
        self._rec = _Recorder()
        self._rec.__enter__()

    def end(self) -> Callable[[], None]:
        rec, self._rec = self._rec, None
        self.last = rec
        assert rec is not None
        rec.__exit__(None, None, None)

        def replay() -> None:
            self.replays += 1
            _replay(rec.ops)
        return replay
