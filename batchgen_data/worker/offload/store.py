"""The weight store: decoder layers whose weights live in host memory and stream to the device.

Each offloaded layer's tensors (parameters and buffers, e.g. a Linear's packed panels) are packed
into one flat host buffer (pinned on CUDA, so the copy is a real DMA). The device keeps only a
small workspace of `num_slots` slots, each as large as the largest offloaded layer. A forward
pre-hook on every offloaded layer (and on each module owning one of its tensors) acquires the
layer when the computation enters it: the slot of the layer left behind is released (all of its
work is enqueued), the layer's bytes are made to be in a slot, its tensors are pointed at views
of that slot, and the next offloaded layer starts copying into another slot. With two slots the
copy of layer i+1 overlaps the compute of layer i (`copy.StreamCopier`); after the last
offloaded layer the first one is prefetched for the next step. The model code is untouched: this works for any decoder
stack exposed as `model.layers`, dense or MoE. With `stream_experts`, an MoE layer's experts are
not in its slot: `experts.ExpertStreamer` copies in only the routed ones when the layer's router
has run (the store is each such layer's `ExpertSource`, given through
`FusedMoE.stream_experts_from`).

Tensors shared with other modules (the rotary cache every layer references, tied embeddings)
stay resident, and so do integer buffers (state such as an MoE layer's per-expert token counts,
which the layer updates and the engine reads between steps). A layer must not write to its own
floating-point weights or buffers in `forward`: the slot copy is not written back. The store counts the bytes it moves and the peak weight bytes resident on the
device (resident tensors plus the layers currently held in slots).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from batchgen_data.layers.moe import FusedMoE
from batchgen_data.worker.offload.copy import Copier, host_buffer, make_copier
from batchgen_data.worker.offload.experts import ExpertStreamer

_ALIGN = 256  # byte alignment of each tensor in a slot (CUDA kernels' and SIMD loads' needs)


@dataclass
class _Entry:
    """One tensor of an offloaded layer: where it sits in the layer's flat buffer."""

    module: nn.Module
    name: str
    is_param: bool
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: torch.Size


@dataclass
class _Layer:
    index: int  # position in model.layers
    host: torch.Tensor  # uint8 [nbytes]: the layer's tensors, packed
    entries: list[_Entry]

    @property
    def nbytes(self) -> int:
        return self.host.numel()


def _unique_tensors(model: nn.Module) -> dict[int, torch.Tensor]:
    found: dict[int, torch.Tensor] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        found.setdefault(id(t), t)
    return found


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every distinct parameter and buffer of `model`."""
    return sum(t.numel() * t.element_size() for t in _unique_tensors(model).values())


def _shared(model: nn.Module) -> tuple[set[int], set[int]]:
    """Ids of modules reachable by more than one path, and of tensors held by more than one
    module: both must stay resident (another layer or the head reads them)."""
    paths = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    modules = {id(sub) for m in model.modules() if paths[id(m)] > 1 for sub in m.modules()}
    refs: Counter[int] = Counter()
    for m in model.modules():
        for t in list(m._parameters.values()) + list(m._buffers.values()):
            if t is not None:
                refs[id(t)] += 1
    return modules, {tid for tid, n in refs.items() if n > 1}


def layer_tensors(layer: nn.Module, shared: tuple[set[int], set[int]],
                  skip: frozenset[int] = frozenset()
                  ) -> list[tuple[nn.Module, str, bool, torch.Tensor]]:
    """(owner, name, is_parameter, tensor) for the tensors only this layer holds, except the
    tensors whose ids are in `skip`."""
    shared_modules, shared_tensors = shared
    shared_tensors = shared_tensors | skip
    out = []
    for m in layer.modules():
        if id(m) in shared_modules:
            continue
        for is_param, table in ((True, m._parameters), (False, m._buffers)):
            for name, t in table.items():
                if t is None or id(t) in shared_tensors or t.numel() == 0:
                    continue
                # floating buffers are weights in a kernel's layout (a Linear's panels);
                # integer ones are state the layer updates or others read between steps
                # (FusedMoE's expert_tokens): streaming would lose the updates
                if not is_param and not t.is_floating_point():
                    continue
                # opaque (oneDNN) or strided tensors have no flat bytes to re-view: resident
                if t.is_mkldnn or not t.is_contiguous():
                    continue
                out.append((m, name, is_param, t))
    return out


def streamed_moes(model: nn.Module, indices: list[int]) -> list[FusedMoE]:
    """The MoE blocks of decoder layers `indices` whose experts are not shared elsewhere."""
    _, shared_tensors = _shared(model)
    return [m for i in indices for m in model.layers[i].modules()
            if isinstance(m, FusedMoE) and id(m.w13) not in shared_tensors]


def layer_bytes(model: nn.Module, aligned: bool = True, experts: bool = True) -> list[int]:
    """Bytes each decoder layer would stream in its slot: its own tensors, padded as in a slot
    (`aligned`) or exact; without its MoE experts (`experts=False`: they stream apart)."""
    shared = _shared(model)
    align = _ALIGN if aligned else 1
    skip = frozenset() if experts else frozenset(
        id(p) for m in model.modules() if isinstance(m, FusedMoE) for p in (m.w13, m.w2))
    return [sum(-(-t.numel() * t.element_size() // align) * align
                for *_, t in layer_tensors(layer, shared, skip)) for layer in model.layers]


class WeightStore:
    """Streams the decoder layers `indices` of `model` through `num_slots` workspace slots on
    `device`. Call before moving the rest of the model to the device: the offloaded tensors
    leave the model here (their parameters keep an empty placeholder until used)."""

    def __init__(self, model: nn.Module, indices: list[int], num_slots: int,
                 device: torch.device, stream_experts: bool = False) -> None:
        assert indices and num_slots >= 1
        self.device = device
        shared = _shared(model)
        # expert-granular streaming: the MoE layers' experts leave the layer slots first (their
        # tensors become empty placeholders, which `_take` skips) and stream per routed expert
        moes = streamed_moes(model, indices) if stream_experts else []
        self.experts = ExpertStreamer(moes, num_slots, device) if moes else None
        for moe in moes:
            moe.stream_experts_from(self)
        self.layers = [self._take(model.layers[i], i, shared, device) for i in indices]
        self.slot_bytes = max(layer.nbytes for layer in self.layers)
        self.workspace = [torch.empty(self.slot_bytes, dtype=torch.uint8, device=device)
                          for _ in range(num_slots)]
        self.copier: Copier = make_copier(device, num_slots)
        self._holder: list[int | None] = [None] * num_slots  # slot -> position in self.layers
        self._slot_of: dict[int, int] = {}
        self._next_victim = 0
        self._current: int | None = None  # the streamed layer bound and being computed
        self.resident_bytes = 0  # set by `finish` once the rest of the model is placed
        self.bytes_moved = 0
        self.peak_resident_bytes = 0
        # a model may call a layer's parts without the layer (attention per micro-batch, then
        # the MLP once): every module that owns a streamed tensor, and the layer, acquire it
        for pos, layer in enumerate(self.layers):  # the hooks live as long as the model
            owners = {id(e.module): e.module for e in layer.entries}
            owners[id(model.layers[layer.index])] = model.layers[layer.index]
            for module in owners.values():
                module.register_forward_pre_hook(self._hook(pos))

    @staticmethod
    def _take(module: nn.Module, index: int, shared: Any, device: torch.device) -> _Layer:
        tensors = layer_tensors(module, shared)
        entries, offset = [], 0
        for owner, name, is_param, t in tensors:
            nbytes = t.numel() * t.element_size()
            entries.append(_Entry(owner, name, is_param, offset, nbytes, t.dtype, t.shape))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        host = host_buffer(offset, device)
        for e, (owner, name, is_param, t) in zip(entries, tensors):
            host[e.offset:e.offset + e.nbytes].copy_(t.detach().reshape(-1).view(torch.uint8))
            placeholder = torch.empty(0, dtype=t.dtype)
            if is_param:
                owner._parameters[name].data = placeholder
            else:
                owner._buffers[name] = placeholder
        return _Layer(index, host, entries)

    def finish(self, model: nn.Module) -> None:
        """Record the resident weight bytes once the rest of `model` is on the device."""
        self.resident_bytes = weight_bytes(model)
        self.peak_resident_bytes = self.resident_bytes

    @property
    def offloaded_bytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def workspace_bytes(self) -> int:
        experts = self.experts.workspace_bytes if self.experts is not None else 0
        return self.slot_bytes * len(self.workspace) + experts

    def _note_peak(self) -> None:
        held = sum(self.layers[p].nbytes for p in self._holder if p is not None)
        if self.experts is not None:
            held += self.experts.held_bytes
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes + held)

    def experts_for(self, moe: FusedMoE, ids: torch.Tensor, counts: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The streamed layer `moe`'s routed experts (its `ExpertSource`), counted in the
        store's bytes moved and peak."""
        assert self.experts is not None
        before = self.experts.bytes_moved
        out = self.experts.experts_for(moe, ids, counts)
        self.bytes_moved += self.experts.bytes_moved - before
        self._note_peak()
        return out

    # ---- streaming ------------------------------------------------------------------------
    def _load(self, pos: int, avoid: int | None) -> int:
        """Start copying layer `pos` into a slot not holding layer `avoid`; returns the slot."""
        n = len(self.workspace)
        slot = next((s for s in range(n) if self._holder[s] is None), None)
        if slot is None:
            slot = self._next_victim
            if n > 1 and self._holder[slot] == avoid:
                slot = (slot + 1) % n
            self._next_victim = (slot + 1) % n
            del self._slot_of[self._holder[slot]]
        layer = self.layers[pos]
        self.copier.copy(slot, self.workspace[slot][:layer.nbytes], layer.host)
        self.bytes_moved += layer.nbytes
        self._holder[slot] = pos
        self._slot_of[pos] = slot
        self._note_peak()
        return slot

    def _bind(self, pos: int, slot: int) -> None:
        base = self.workspace[slot]
        for e in self.layers[pos].entries:
            view = base[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)
            if e.is_param:
                e.module._parameters[e.name].data = view
            else:
                e.module._buffers[e.name] = view

    def _acquire(self, pos: int) -> None:
        """Make layer `pos` the bound one: the previous one's work is all enqueued, so its slot
        is released; `pos` is copied if no prefetch brought it, waited on and bound; the next
        streamed layer starts copying into a free slot (overlapping this layer's compute)."""
        if self._current is not None:
            self.copier.release(self._slot_of[self._current])
        slot = self._slot_of.get(pos)
        if slot is None:  # not prefetched (the first step, or a single slot)
            slot = self._load(pos, avoid=None)
        self.copier.wait_ready(slot)
        self._bind(pos, slot)
        self._current = pos
        nxt = (pos + 1) % len(self.layers)
        if len(self.workspace) > 1 and nxt not in self._slot_of:
            self._load(nxt, avoid=pos)

    def _hook(self, pos: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            if self._current != pos:
                self._acquire(pos)
        return hook
