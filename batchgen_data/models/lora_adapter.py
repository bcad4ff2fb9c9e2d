"""A PEFT LoRA adapter read from a local directory and checked against the model it will run on.

A directory holds `adapter_config.json` and `adapter_model.safetensors`, whose tensors are named
`base_model.model.<module>.lora_A.weight` ([r, in]) and `...lora_B.weight` ([out, r]). The
engine can target the attention projections q/k/v/o of every decoder layer (dense and MoE) and
the dense MLP's gate/up/down. Everything else is refused with a ValueError that names it: DoRA,
biases, `modules_to_save`, embedding or head adapters, experts, a rank over `max_lora_rank`,
tensors whose shapes do not fit the model (an adapter trained for another base).

The scale is PEFT's: `lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`; it is folded
into B here, so the layers only add (x A^T) B^T.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

# the engine's targets: (part of a decoder layer, projection) → the fused layer and its shard
ATTENTION_TARGETS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1),
                     "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0)}
MLP_TARGETS = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
               "down_proj": ("down_proj", 0)}
# a PEFT module over a projection some checkpoints store fused (Phi-3's qkv_proj, gate_up_proj):
# its delta B A is the pieces' deltas stacked, so each piece takes the one A and its rows of B
FUSED_TARGETS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                 "gate_up_proj": ("gate_proj", "up_proj")}
_NAME = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)"
                   r"\.lora_([AB])(?:\.default)?\.weight$")


@dataclass(frozen=True)
class TargetShape:
    """What the model offers an adapter: (in, out) of each projection per layer, and which
    layers have a dense MLP (MoE layers offer attention only)."""

    num_layers: int
    attention: dict[str, tuple[int, int]]  # q_proj → (in, out), ...
    mlp: dict[str, tuple[int, int]]  # gate_proj → (in, out), ...
    dense_mlp_layers: frozenset[int]


@dataclass
class AdapterWeights:
    """One adapter on the host: per (layer, fused layer name, shard) its A [r, in] and its
    scaled B [out, r], fp32."""

    name: str
    rank: int  # the largest rank of its modules
    modules: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self.modules.values())


def _config(path: Path) -> dict:
    cfg_file = path / "adapter_config.json"
    if not path.is_dir():
        raise ValueError(f"LoRA adapter {str(path)!r}: not a directory")
    if not cfg_file.is_file():
        raise ValueError(f"LoRA adapter {str(path)!r}: no adapter_config.json")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {str(path)!r}: adapter_config.json unreadable ({e})") \
            from None
    if not isinstance(cfg, dict):
        raise ValueError(f"LoRA adapter {str(path)!r}: adapter_config.json is not an object")
    return cfg


def _refusals(cfg: dict, where: str) -> None:
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"{where}: peft_type={peft_type!r}; only LoRA adapters load")
    if cfg.get("use_dora"):
        raise ValueError(f"{where}: use_dora=true: DoRA adapters are not supported")
    if cfg.get("bias", "none") not in ("none", None):
        raise ValueError(f"{where}: bias={cfg['bias']!r}: adapters that train biases are not "
                         "supported (bias must be 'none')")
    if cfg.get("modules_to_save"):
        raise ValueError(f"{where}: modules_to_save={cfg['modules_to_save']!r}: fully trained "
                         "modules are not supported, only low-rank ones")
    if cfg.get("fan_in_fan_out"):
        raise ValueError(f"{where}: fan_in_fan_out=true is for Conv1D models; not supported")
    if cfg.get("alpha_pattern"):
        raise ValueError(f"{where}: alpha_pattern is not supported (one lora_alpha for all)")


def load_adapter(path: str, name: str, shape: TargetShape, max_rank: int) -> AdapterWeights:
    """The adapter at `path`, checked against `shape` and `max_rank`; ValueError otherwise."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(path).expanduser()
    where = f"LoRA adapter {name!r} ({str(root)!r})"
    cfg = _config(root)
    _refusals(cfg, where)
    weights = root / "adapter_model.safetensors"
    if not weights.is_file():
        extra = " (adapter_model.bin is not read: save with safe_serialization)" \
            if (root / "adapter_model.bin").exists() else ""
        raise ValueError(f"{where}: no adapter_model.safetensors{extra}")
    try:
        tensors = load_file(str(weights))
    except (OSError, SafetensorError) as e:
        raise ValueError(f"{where}: adapter_model.safetensors unreadable ({e})") from None
    alpha = float(cfg.get("lora_alpha", cfg.get("r", 8)))
    rslora = bool(cfg.get("use_rslora", False))
    pairs: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _NAME.match(key)
        if m is None:
            raise ValueError(f"{where}: tensor {key!r} is not a LoRA weight of a module this "
                             "engine can target (q/k/v/o_proj, gate/up/down_proj of a dense "
                             "MLP)")
        layer, part, proj, ab = int(m[1]), m[2], m[3], m[4]
        pairs.setdefault((layer, part, proj), {})[ab] = t
    pairs = _split_fused(pairs, shape, where)
    if not pairs:
        raise ValueError(f"{where}: adapter_model.safetensors holds no LoRA weights")
    modules: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]] = {}
    top_rank = 0
    for (layer, part, proj), ab in sorted(pairs.items()):
        mod = f"model.layers.{layer}.{part}.{proj}"
        targets = ATTENTION_TARGETS if part == "self_attn" else MLP_TARGETS
        dims = (shape.attention if part == "self_attn" else shape.mlp).get(proj)
        if proj not in targets or dims is None:
            raise ValueError(f"{where}: module {mod!r} cannot be targeted (supported: "
                             "q/k/v/o_proj, gate/up/down_proj of a dense MLP)")
        if layer >= shape.num_layers:
            raise ValueError(f"{where}: module {mod!r}: the base model has {shape.num_layers} "
                             "layers (an adapter for another base model?)")
        if part == "mlp" and layer not in shape.dense_mlp_layers:
            raise ValueError(f"{where}: module {mod!r}: layer {layer}'s MLP is a mixture of "
                             "experts; expert adapters are not supported")
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: module {mod!r} has lora_{''.join(ab)} only")
        a, b = ab["A"].float(), ab["B"].float()
        r = a.shape[0]
        fan_in, fan_out = dims
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (r, fan_in) \
                or tuple(b.shape) != (fan_out, r):
            raise ValueError(f"{where}: module {mod!r}: lora_A {list(a.shape)} and lora_B "
                             f"{list(b.shape)} do not fit the base model's [{fan_out}, "
                             f"{fan_in}] weight (an adapter for another base model?)")
        if r > max_rank:
            raise ValueError(f"{where}: module {mod!r} has rank {r}, over max_lora_rank="
                             f"{max_rank} (raise max_lora_rank)")
        scale = alpha / (math.sqrt(r) if rslora else r)
        fused, shard = targets[proj]
        modules[(layer, fused, shard)] = (a.contiguous(), (b * scale).contiguous())
        top_rank = max(top_rank, r)
    return AdapterWeights(name, top_rank, modules)


def _split_fused(pairs: dict[tuple[int, str, str], dict[str, torch.Tensor]], shape: TargetShape,
                 where: str) -> dict[tuple[int, str, str], dict[str, torch.Tensor]]:
    """`pairs` with each fused module's (A, B) given to its pieces: the same A, B cut by the
    pieces' output widths (ValueError naming the module when they do not add up)."""
    out: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    for (layer, part, proj), ab in pairs.items():
        pieces = FUSED_TARGETS.get(proj)
        if pieces is None or "B" not in ab or "A" not in ab:
            out[(layer, part, proj)] = ab
            continue
        table = shape.attention if part == "self_attn" else shape.mlp
        widths = [table.get(piece, (0, 0))[1] for piece in pieces]
        if sum(widths) != ab["B"].shape[0] or 0 in widths:
            raise ValueError(f"{where}: module 'model.layers.{layer}.{part}.{proj}': lora_B "
                             f"{list(ab['B'].shape)} does not split into {'+'.join(pieces)} "
                             f"of {widths} rows")
        for piece, b in zip(pieces, ab["B"].split(widths)):
            out[(layer, part, piece)] = {"A": ab["A"], "B": b}
    return out
