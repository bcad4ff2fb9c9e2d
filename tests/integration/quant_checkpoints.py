"""Quantized checkpoints of tiny models, written in each format's published layout, with the
dequantized weights beside them as a dense checkpoint (the weight-only oracle for HF `generate`).

compressed-tensors: the `compressed-tensors` package packs the codes (`pack_to_int32`) and
writes the config (`QuantizationConfig`), so the layout is the package's, not ours; HF
transformers can load the result itself. fp8 (DeepSeek/Qwen FP8): `float8_e4m3fn` weights with
`weight_scale_inv` per `weight_block_size` block, as DeepSeek-V3's config documents.
Which tensors are quantized: every 2-D projection (`*_proj.weight`, experts' `w1/w2/w3`), never
embeddings, norms, the output head or a router.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_TARGET = re.compile(r"(_proj|\.w[123])\.weight$")
FP8_MAX = 448.0


def _int_quantize(w: torch.Tensor, bits: int, group: int | None, symmetric: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(codes int8 [n, k], scale [n, G], zero int8 [n, G] or None, dequantized [n, k])."""
    n, k = w.shape
    g = k if group is None else group
    groups = -(-k // g)
    pad = groups * g - k
    wp = torch.nn.functional.pad(w, (0, pad)).view(n, groups, g)
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if pad:  # the padding must not widen the last group's range
        mask = torch.arange(groups * g).view(groups, g) < k
        lo = torch.where(mask, wp, torch.inf).amin(-1)
        hi = torch.where(mask, wp, -torch.inf).amax(-1)
    else:
        lo, hi = wp.amin(-1), wp.amax(-1)
    if symmetric:
        scale = torch.maximum(lo.abs(), hi.abs()) / ((qmax - qmin) / 2)
        zero = torch.zeros_like(scale)
    else:
        lo, hi = torch.minimum(lo, torch.zeros_like(lo)), torch.maximum(hi, torch.zeros_like(hi))
        scale = (hi - lo) / (qmax - qmin)
        zero = torch.clamp(torch.round(qmin - lo / scale), qmin, qmax)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.clamp(torch.round(wp / scale[..., None]) + zero[..., None], qmin, qmax)
    deq = ((q - zero[..., None]) * scale[..., None]).view(n, -1)[:, :k]
    codes = q.view(n, -1)[:, :k].to(torch.int8)
    return codes, scale, (None if symmetric else zero.to(torch.int8)), deq


def _fp8_quantize(w: torch.Tensor, block: tuple[int, int] | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight [n, k], scale [n, 1] or per block, dequantized [n, k])."""
    n, k = w.shape
    if block is None:
        scale = w.abs().amax(-1, keepdim=True) / FP8_MAX
        full = scale
    else:
        b0, b1 = block
        rows, cols = -(-n // b0), -(-k // b1)
        padded = torch.nn.functional.pad(w.abs(), (0, cols * b1 - k, 0, rows * b0 - n))
        scale = padded.view(rows, b0, cols, b1).amax(dim=(1, 3)) / FP8_MAX
        full = scale.repeat_interleave(b0, 0)[:n].repeat_interleave(b1, 1)[:, :k]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.float(), q.float() * full


def _ct_config(kind: str, bits: int, group: int | None, symmetric: bool) -> dict:
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig,
                                                 QuantizationScheme)

    if kind == "float":
        args = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True)
        fmt = "float-quantized"
    else:
        args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric,
                                strategy="channel" if group is None else "group",
                                group_size=group)
        fmt = "pack-quantized"
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    cfg = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"],
                             format=fmt, quantization_status="compressed")
    out = cfg.model_dump()
    out["quant_method"] = "compressed-tensors"
    return out


def write_quantized(src: Path, dst: Path, dequant: Path, method: str, bits: int = 8,
                    group: int | None = None, symmetric: bool = True,
                    block: tuple[int, int] | None = None) -> tuple[Path, Path]:
    """Quantize `src`'s projections into `dst` (`method`: "pack" = compressed-tensors
    pack-quantized INT`bits`, "float" = compressed-tensors FP8 per channel, "fp8" = FP8 with
    `block` scales) and write the dequantized weights as a dense checkpoint to `dequant`."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    for d in (dst, dequant):
        shutil.copytree(src, d, dirs_exist_ok=True)
        for f in d.glob("*.safetensors"):
            f.unlink()
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    out, dense = {}, {}
    for name, w in tensors.items():
        if not _TARGET.search(name) or w.dim() != 2:
            out[name] = dense[name] = w
            continue
        prefix = name[: -len(".weight")]
        w = w.float()
        if method == "pack":
            codes, scale, zero, deq = _int_quantize(w, bits, group, symmetric)
            out[f"{prefix}.weight_packed"] = pack_to_int32(codes, bits)
            out[f"{prefix}.weight_scale"] = scale.to(tensors[name].dtype)
            out[f"{prefix}.weight_shape"] = torch.tensor(list(w.shape))
            if zero is not None:
                out[f"{prefix}.weight_zero_point"] = pack_to_int32(zero, bits, packed_dim=0)
            # the oracle dequantizes with the scale as stored (in the checkpoint's dtype)
            deq = _int_dequant(codes, out[f"{prefix}.weight_scale"].float(), zero, group)
        else:
            q, scale, deq = _fp8_quantize(w, block if method == "fp8" else None)
            out[f"{prefix}.weight"] = q
            out[f"{prefix}.weight_scale_inv" if method == "fp8" else f"{prefix}.weight_scale"] \
                = scale
        dense[name] = deq.to(tensors[name].dtype)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    save_file(dense, str(dequant / "model.safetensors"), metadata={"format": "pt"})
    cfg_path = dst / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if method == "fp8":
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                      "activation_scheme": "dynamic",
                                      "weight_block_size": list(block or (128, 128))}
    else:
        cfg["quantization_config"] = _ct_config("int" if method == "pack" else "float", bits,
                                                group, symmetric)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return dst, dequant


def _int_dequant(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                 group: int | None) -> torch.Tensor:
    k = codes.shape[1]
    index = torch.arange(k) // (k if group is None else group)
    z = 0.0 if zero is None else zero.float()[:, index]
    return (codes.float() - z) * scale[:, index]
