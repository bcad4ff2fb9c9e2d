"""A checkpoint's `quantization_config` -> the format its tensors are in and how layers store it.

The checkpoint alone decides (no flag): `quant_method` "compressed-tensors" (formats
"pack-quantized": INT4/INT8 packed in int32, per channel or per group, symmetric or not;
"int-quantized": INT8 as int8; "float-quantized": FP8 per tensor, per channel or in blocks) or
"fp8" (DeepSeek-V3 / Qwen3 FP8: e4m3 weights, `weight_scale_inv` per `weight_block_size` block,
or a per-tensor `weight_scale`). vLLM's `quantization=` is accepted when it names the same
method (its kernel-specific aliases included) and refused with a ValueError otherwise. Activation
quantization in the config (W8A8) is not applied: the layers multiply fp32/bf16 activations by
the dequantized weight (weight-only semantics), which docs/quantization.md states.

What is refused, before the model is built: another method or format, bit widths other than 4/8
(int) or 8 (float), compressed-tensors group orderings that need `weight_g_idx`, AWQ other than
GEMM, mixed schemes across layers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchgen_data.layers.quant import QuantScheme

# vLLM's names for the same checkpoint method (kernel choices there, one method here)
_ALIASES = {"compressed-tensors": ("compressed-tensors", "compressed_tensors"),
            "fp8": ("fp8", "fbgemm_fp8"),
            "gptq": ("gptq", "gptq_marlin", "marlin"),
            "awq": ("awq", "awq_marlin")}
SUPPORTED = ("compressed-tensors", "fp8", "gptq", "awq", "mxfp4")
_CT_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")


@dataclass(frozen=True)
class CheckpointQuant:
    """The quantization of a checkpoint: its `method`, tensor `format`, the stored `scheme`, the
    FP8 block [rows, cols] of its scales (None: per tensor / channel / group)."""

    method: str
    format: str
    scheme: QuantScheme
    block: tuple[int, int] | None = None
    # GPTQ: columns in activation order (`g_idx`), and what its zeros are stored off by (v1
    # checkpoints keep zero - 1)
    act_order: bool = False
    zero_offset: int = 0


def raw_config(hf_config: Any) -> dict[str, Any] | None:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None or isinstance(qc, dict):
        return qc
    return qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))


def parse(hf_config: Any, requested: str | None = None) -> CheckpointQuant | None:
    """The checkpoint's quantization (None: a floating-point checkpoint), checked against the
    user's `quantization=` (vLLM's name; None: whatever the checkpoint says)."""
    qc = raw_config(hf_config)
    if qc is None:
        if requested is not None:
            raise ValueError(f"quantization={requested!r}, but the checkpoint has no "
                             "quantization_config (it is not quantized); drop the argument")
        return None
    method = str(qc.get("quant_method", "")).lower()
    method = "compressed-tensors" if method == "compressed_tensors" else method
    if requested is not None and requested not in _ALIASES.get(method, (method,)):
        raise ValueError(f"quantization={requested!r} disagrees with the checkpoint's "
                         f"quantization_config.quant_method={qc.get('quant_method')!r}; drop the "
                         "argument (the checkpoint decides) or pass the matching name")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fp8":
        return _fp8(qc)
    if method == "gptq":
        return _gptq(qc)
    if method == "awq":
        return _awq(qc)
    if method == "mxfp4":  # gpt-oss: its experts' blocks and scales are the model's own stored
        return None  # form (layers/mxfp4.py); every other weight is dense
    raise ValueError(f"quantization_config.quant_method={qc.get('quant_method')!r} is not "
                     f"supported; supported: {SUPPORTED} (docs/quantization.md)")


def _group_size(qc: dict[str, Any]) -> int | None:
    size = qc.get("group_size", -1)
    if size == -1 or size is None:
        return None
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"quantization_config.group_size={size!r}: an int >= 1, or -1")
    return size


def _gptq(qc: dict[str, Any]) -> CheckpointQuant:
    bits = qc.get("bits")
    if bits not in (4, 8):
        raise ValueError(f"quantization_config.bits={bits!r}: GPTQ with 4 or 8 bits is "
                         "supported")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"quantization_config.checkpoint_format={fmt!r}: use gptq or gptq_v2")
    return CheckpointQuant("gptq", "gptq", QuantScheme(f"int{bits}", _group_size(qc),
                                                       bool(qc.get("sym", True))),
                           act_order=bool(qc.get("desc_act", False)),
                           zero_offset=1 if fmt == "gptq" else 0)


def _awq(qc: dict[str, Any]) -> CheckpointQuant:
    bits, version = qc.get("bits", qc.get("w_bit")), str(qc.get("version", "gemm")).lower()
    if bits != 4:
        raise ValueError(f"quantization_config.bits={bits!r}: AWQ with 4 bits is supported")
    if version != "gemm":
        raise ValueError(f"quantization_config.version={version!r}: AWQ's GEMM packing is "
                         "supported (not GEMV / Marlin)")
    if not qc.get("zero_point", True):
        raise ValueError("quantization_config.zero_point=False: AWQ without zero points is not "
                         "supported")
    size = _group_size({"group_size": qc.get("group_size", qc.get("q_group_size", -1))})
    return CheckpointQuant("awq", "awq", QuantScheme("int4", size, symmetric=False))


def _fp8(qc: dict[str, Any]) -> CheckpointQuant:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt={fmt!r}: only e4m3 FP8 weights are supported")
    block = qc.get("weight_block_size")
    if block is None:
        return CheckpointQuant("fp8", "fp8", QuantScheme("fp8"))
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and b >= 1 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size={block!r}: want [rows, cols]")
    return CheckpointQuant("fp8", "fp8", QuantScheme("fp8", block[1]), (block[0], block[1]))


def _compressed_tensors(qc: dict[str, Any]) -> CheckpointQuant:
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError("quantization_config.config_groups is empty: no quantized layers")
    parsed = {name: _ct_group(name, g, qc.get("format")) for name, g in groups.items()}
    first = next(iter(parsed.values()))
    for name, other in parsed.items():
        if other != first:
            raise ValueError(f"quantization_config.config_groups.{name} differs from the first "
                             "group; one scheme for every quantized layer is supported")
    return first


def _ct_group(name: str, group: dict[str, Any], top_format: str | None) -> CheckpointQuant:
    where = f"quantization_config.config_groups.{name}"
    fmt = group.get("format") or top_format
    if fmt not in _CT_FORMATS:
        raise ValueError(f"{where}.format={fmt!r} is not supported; supported: {_CT_FORMATS}")
    w = group.get("weights")
    if not w:
        raise ValueError(f"{where}.weights is missing: activation-only quantization is not "
                         "supported")
    bits, kind_of = w.get("num_bits"), w.get("type", "int")
    strategy = w.get("strategy", "tensor")
    if w.get("actorder") not in (None, "static", "weight", False):
        raise ValueError(f"{where}.weights.actorder={w.get('actorder')!r}: group orderings that "
                         "need weight_g_idx are not supported")
    if kind_of == "float":
        if bits != 8 or fmt != "float-quantized":
            raise ValueError(f"{where}.weights: float num_bits={bits!r} (format {fmt!r}); only "
                             "8-bit FP8 in float-quantized is supported")
        if strategy == "block":
            block = w.get("block_structure")
            if not (isinstance(block, (list, tuple)) and len(block) == 2):
                raise ValueError(f"{where}.weights.block_structure={block!r}: want [rows, cols]")
            return CheckpointQuant("compressed-tensors", fmt, QuantScheme("fp8", int(block[1])),
                                   (int(block[0]), int(block[1])))
        if strategy not in ("tensor", "channel"):
            raise ValueError(f"{where}.weights.strategy={strategy!r} for FP8: use tensor, "
                             "channel or block")
        return CheckpointQuant("compressed-tensors", fmt, QuantScheme("fp8"))
    if kind_of != "int" or bits not in (4, 8):
        raise ValueError(f"{where}.weights: {kind_of} num_bits={bits!r} is not supported; "
                         "int 4 or 8 bits (or float 8)")
    if fmt == "float-quantized" or (bits == 4 and fmt != "pack-quantized"):
        raise ValueError(f"{where}: int{bits} weights in format {fmt!r} are not supported")
    if strategy == "group":
        size = w.get("group_size")
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{where}.weights.group_size={size!r}: must be an int >= 1")
    elif strategy == "channel":
        size = None
    else:
        raise ValueError(f"{where}.weights.strategy={strategy!r} for int weights: use channel "
                         "or group")
    symmetric = bool(w.get("symmetric", True))
    return CheckpointQuant("compressed-tensors", fmt,
                           QuantScheme(f"int{bits}", size, symmetric))
