"""Python objects between the processes of an engine group, over its `control` group (gloo).

A TP engine's steps travel as fixed int64 payloads (`step_io.py`); the engines of a group that
can re-partition (engine/group/group.py) also exchange things of any shape while they run as
separate engines: requests to submit, finished outputs, load reports, exported sequences with
their KV. Those go pickled, as one uint8 tensor: `send` from rank 0 to every rank (a length,
then the bytes), `gather` from every rank to rank 0 (lengths all-gathered, then one gather of
buffers padded to the longest). Rank 0 waits on each at most the group's `collective_timeout_s`
(`TensorParallel`), so a peer that dies or stalls mid-message is an error, never a hang. Only
processes of the same engine group, started by it, read these bytes. Tensors of one-byte float
types (an FP8 KV cache's e4m3 codes) travel as their bytes: torch's own pickling of them does
not load back.
"""
from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from batchgen_data.layers.parallel import TensorParallel


_AS_BYTES = {torch.float8_e4m3fn, torch.float8_e5m2}


def _from_bytes(raw: torch.Tensor, dtype: str) -> torch.Tensor:
    return raw.view(getattr(torch, dtype))


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.dtype in _AS_BYTES:
            raw = obj.detach().contiguous().view(torch.uint8)
            return _from_bytes, (raw, str(obj.dtype).removeprefix("torch."))
        return NotImplemented


def encode(obj: Any) -> torch.Tensor:
    """`obj` pickled into a uint8 tensor (one-byte float tensors as their bytes)."""
    out = io.BytesIO()
    _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8)


def decode(buf: torch.Tensor) -> Any:
    return pickle.loads(buf.numpy().tobytes())


def send(control: TensorParallel, obj: Any) -> None:
    """Rank 0: `obj` to every other rank (each calls `receive`)."""
    blob = encode(obj)
    control.broadcast(torch.tensor([blob.numel()], dtype=torch.int64))
    control.broadcast(blob)


def receive(control: TensorParallel) -> Any:
    """Ranks > 0: what rank 0 `send`s next."""
    n = int(control.broadcast(torch.zeros(1, dtype=torch.int64))[0])
    return decode(control.broadcast(torch.empty(n, dtype=torch.uint8)))


def gather(control: TensorParallel, obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on rank 0 (its own included); [] elsewhere."""
    blob = encode(obj)
    sizes = [int(n) for n in control.all_gather(torch.tensor([blob.numel()],
                                                             dtype=torch.int64))]
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[:blob.numel()] = blob
    parts = control.gather(padded)
    return [decode(p[:n]) for p, n in zip(parts, sizes)]
