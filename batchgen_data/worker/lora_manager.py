"""Which LoRA adapters an engine knows, which sit in host memory and which in device slots.

An adapter is read from its directory once, when a request first names it (`check`, on the
submitting thread, so a connector's row thread pays for the disk while the engine steps): it is
checked against the model (models/lora_adapter.py) and kept in host memory, at most
`max_cpu_loras` of them, least recently used out first (an adapter dropped there is read again
when a row needs it). Before each step the runner asks for the step's adapters to be resident
(`ensure_resident`): each missing one takes a free device slot, or the least recently used slot
of an adapter that has no row in this step, and every adapted layer's slot is filled from the
host copy. The scheduler never runs more than `max_loras` adapters at once (`Scheduler.
max_loras`), so the step's adapters always fit. The runner then turns each token row's slot into
the step's `LoRABatch`, which the adapted layers read through the shared `LoRAContext`.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from batchgen_data.config import LoRAConfig
from batchgen_data.layers.backend import LayerBackend
from batchgen_data.layers.linear import Linear
from batchgen_data.layers.lora import LoRABatch, LoRAContext, LoRADelta
from batchgen_data.lora_request import AdapterNames, LoRARequest
from batchgen_data.models.lora_adapter import AdapterWeights, TargetShape, load_adapter

if TYPE_CHECKING:
    from batchgen_data.config import EngineConfig


class AdaptedRunner(Protocol):
    """What `attach` reads of the runner whose steps the adapters join: the backend its layers
    were built for, and whether its KV host tier or weight store is in use."""

    backend: LayerBackend
    kv_tier: object | None
    weight_store: object | None


def _adaptable(model: torch.nn.Module) -> None:
    layers = getattr(model, "layers", None)
    if layers is None or not all(hasattr(getattr(layer, "self_attn", None), "qkv_proj")
                                 for layer in layers):
        raise ValueError(f"enable_lora: {type(model).__name__} has no LoRA support here "
                         "(decoders with q|k|v attention: Llama, Qwen2/3, Mistral and their "
                         "MoE models)")


def _kernel(backend: LayerBackend) -> str:
    if backend.triton:
        return "triton"
    if backend.device.type == "cpu" and backend.dtype == torch.float32:
        from batchgen_data.kernels.cpu import lora as cpu_lora

        if cpu_lora.available():
            return "c"
    return "torch"


class LoRAManager:
    def __init__(self, model: torch.nn.Module, config: LoRAConfig,
                 backend: LayerBackend) -> None:
        _adaptable(model)
        self.config = config
        self.ctx = LoRAContext()
        self.device, self.dtype = backend.device, backend.dtype
        self.kernel = _kernel(backend)  # how every adapted layer adds its deltas
        # (layer index, fused layer name) → its slots
        self.deltas: dict[tuple[int, str], LoRADelta] = {}
        dense: set[int] = set()
        for i, layer in enumerate(model.layers):
            attn = layer.self_attn
            self._attach(i, "qkv_proj", attn.qkv_proj, backend)
            self._attach(i, "o_proj", attn.o_proj, backend)
            mlp = layer.mlp
            if isinstance(getattr(mlp, "gate_up_proj", None), Linear):  # a dense MLP
                dense.add(i)
                self._attach(i, "gate_up_proj", mlp.gate_up_proj, backend)
                self._attach(i, "down_proj", mlp.down_proj, backend)
        attn0 = model.layers[0].self_attn
        # the checkpoint's (whole) sizes: an adapter is checked whole, then cut to this rank's
        # part (`_rank_part`), as the base weights are
        self.model, tp = model, getattr(getattr(model, "shape", None), "tp", None)
        self.tp_size = getattr(tp, "size", 1) if tp is not None else 1
        q, kv = attn0.qkv_proj.shard_sizes[0], attn0.qkv_proj.shard_sizes[1]
        if self.tp_size > 1:
            q = q * self.tp_size
            kv = model.shape.total_kv_heads * model.shape.head_dim
        hidden = attn0.qkv_proj.in_features
        mlp_dims: dict[str, tuple[int, int]] = {}
        if dense:
            width = model.layers[min(dense)].mlp.down_proj.in_features * self.tp_size
            mlp_dims = {"gate_proj": (hidden, width), "up_proj": (hidden, width),
                        "down_proj": (width, hidden)}
        self.shape = TargetShape(len(model.layers),
                                 {"q_proj": (hidden, q), "k_proj": (hidden, kv),
                                  "v_proj": (hidden, kv), "o_proj": (q, hidden)},
                                 mlp_dims, frozenset(dense))
        self._lock = threading.Lock()  # `check` runs on connector threads
        self._known: dict[int, LoRARequest] = {}
        self._host: OrderedDict[int, AdapterWeights] = OrderedDict()  # LRU, oldest first
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id → slot, LRU
        self._free = list(range(config.max_loras - 1, -1, -1))
        self.disk_loads = 0  # adapters read from their directory
        self.slot_loads = 0  # adapters copied into a device slot
        self.slot_evictions = 0
        # a tensor-parallel rank 0: told of each slot it fills, so the other ranks fill theirs
        self.on_fill: Callable[[int, LoRARequest], None] | None = None

    def _attach(self, i: int, name: str, linear: Linear, backend: LayerBackend) -> None:
        shards = getattr(linear, "shard_sizes", [linear.out_features])
        delta = LoRADelta(self.ctx, linear.in_features, shards, self.config.max_loras,
                          self.config.max_lora_rank, backend.device, backend.dtype,
                          self.kernel)
        linear.lora = delta
        self.deltas[(i, name)] = delta

    # ---- any thread -----------------------------------------------------------------------
    def check(self, req: LoRARequest) -> None:
        """Know `req` and hold its weights in host memory; ValueError when it cannot run here
        (unreadable, refused by the loader, or its id already names another adapter)."""
        if not isinstance(req, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(req).__name__}")
        with self._lock:
            known = self._known.get(req.lora_int_id)
            if known is not None and known != req:
                raise ValueError(f"lora_int_id={req.lora_int_id} already names adapter "
                                 f"{known.lora_name!r} at {known.lora_path!r}; give "
                                 f"{req.lora_name!r} its own id")
            if req.lora_int_id in self._host:
                self._host.move_to_end(req.lora_int_id)
                return
        weights = self._read(req)  # outside the lock: the disk is the slow part
        with self._lock:
            self._known.setdefault(req.lora_int_id, req)
            self._keep(req.lora_int_id, weights)

    def _read(self, req: LoRARequest) -> AdapterWeights:
        weights = load_adapter(req.lora_path, req.lora_name, self.shape,
                               self.config.max_lora_rank)
        self.disk_loads += 1
        return self._rank_part(weights) if self.tp_size > 1 else weights

    def _rank_part(self, weights: AdapterWeights) -> AdapterWeights:
        """This rank's part of an adapter, cut as its layer's weight is cut
        (`tp_shards.rank_slice`): B's output rows of a column-parallel layer (q|k|v by heads,
        gate|up), A's input columns of a row-parallel one (o, down), whose partial products
        the layer's all-reduce sums with the base product's."""
        from batchgen_data.models import tp_shards

        out = {}
        for (layer, fused, shard), (a, b) in weights.modules.items():
            part = "self_attn" if fused in ("qkv_proj", "o_proj") else "mlp"
            name = f"layers.{layer}.{part}.{fused}.weight"
            if fused in ("o_proj", "down_proj"):
                a = tp_shards.rank_slice(self.model, name, shard, a).contiguous()
            else:
                b = tp_shards.rank_slice(self.model, name, shard, b).contiguous()
            out[(layer, fused, shard)] = (a, b)
        return AdapterWeights(weights.name, weights.rank, out)

    def fill_slot(self, slot: int, req: LoRARequest) -> None:
        """A tensor-parallel rank > 0: slot `slot` takes adapter `req`, as rank 0's did (read
        from its directory here: every rank's node needs the adapter's path)."""
        self._fill(slot, self._read(req))

    def _keep(self, lora_id: int, weights: AdapterWeights) -> None:
        self._host[lora_id] = weights
        self._host.move_to_end(lora_id)
        while len(self._host) > self.config.host_capacity:
            self._host.popitem(last=False)

    def host_resident(self) -> list[int]:
        with self._lock:
            return list(self._host)

    # ---- engine thread --------------------------------------------------------------------
    def device_resident(self) -> list[int]:
        return list(self._slot_of)

    def ensure_resident(self, ids: set[int]) -> None:
        """Give every adapter in `ids` (at most `max_loras`) a device slot."""
        assert len(ids) <= self.config.max_loras, (len(ids), self.config.max_loras)
        for lora_id in ids:
            if lora_id in self._slot_of:
                self._slot_of.move_to_end(lora_id)
        for lora_id in sorted(i for i in ids if i not in self._slot_of):
            if self._free:
                slot = self._free.pop()
            else:
                victim = next(v for v in self._slot_of if v not in ids)
                slot = self._slot_of.pop(victim)
                self.slot_evictions += 1
            self._fill(slot, self._weights(lora_id))
            self._slot_of[lora_id] = slot
            if self.on_fill is not None:
                self.on_fill(slot, self._known[lora_id])

    def _weights(self, lora_id: int) -> AdapterWeights:
        with self._lock:
            weights = self._host.get(lora_id)
            req = self._known[lora_id]
            if weights is not None:
                self._host.move_to_end(lora_id)
                return weights
        weights = self._read(req)  # dropped from host memory since: read it again
        with self._lock:
            self._keep(lora_id, weights)
        return weights

    def _fill(self, slot: int, weights: AdapterWeights) -> None:
        per_layer: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, fused, shard), ab in weights.modules.items():
            per_layer.setdefault((layer, fused), {})[shard] = ab
        for key, delta in self.deltas.items():
            delta.load(slot, {s: (a.to(self.device, self.dtype), b.to(self.device, self.dtype))
                              for s, (a, b) in per_layer.get(key, {}).items()})
        self.slot_loads += 1

    def slot(self, lora_id: int) -> int:
        return self._slot_of[lora_id]

    def batch(self, token_slots: list[int]) -> LoRABatch | None:
        return LoRABatch.build(token_slots, self.config.max_loras, self.device, self.dtype)


def attach(model: torch.nn.Module, runner: AdaptedRunner, config: "EngineConfig"
           ) -> LoRAManager:
    """The manager of an engine started with enable_lora; ValueError for what it cannot
    combine with (the adapted layers see the whole step's rows at once)."""
    if runner.kv_tier is not None:
        raise ValueError("enable_lora with host_kv_tier_bytes > 0 is not supported yet "
                         "(attention runs per micro-batch there)")
    if config.attention_micro_batch_seqs is not None:
        raise ValueError("enable_lora with attention_micro_batch_seqs is not supported yet")
    if runner.weight_store is not None:
        raise ValueError("enable_lora with streamed weights (cpu_offload_gb, "
                         "weight_memory_bytes) is not supported yet")
    manager = LoRAManager(model, config.lora, runner.backend)
    manager.on_fill = getattr(runner, "lora_filled", None)  # a TP rank 0 tells its ranks
    return manager


def adapter_names_for(config: Any) -> AdapterNames | None:
    """How rows name adapters for an engine of `config` (`EngineConfig`): a `lora` column, or
    a row's `model` under its `dynamic_lora_loading_path`; None without enable_lora."""
    lora = config.lora
    if not lora.enable_lora:
        return None
    from batchgen_data.models.default_model import DEFAULT_MODEL

    model = str(config.model or DEFAULT_MODEL)
    return AdapterNames(lora.dynamic_lora_loading_path,
                        frozenset({model, os.path.basename(os.path.normpath(model))}))


def check_adapter(manager: Any, lora_request: LoRARequest | None) -> None:
    """ValueError unless an engine with this LoRA `manager` (None: started without
    enable_lora) can run `lora_request`."""
    if lora_request is None:
        return
    if manager is None:
        raise ValueError(f"LoRA adapter {getattr(lora_request, 'lora_name', lora_request)!r}"
                         ": this engine was started without enable_lora=True")
    manager.check(lora_request)
