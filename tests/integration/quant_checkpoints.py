"""Quantized checkpoints of tiny models, written in each format's published layout, with the
dequantized weights beside them as a dense checkpoint (the weight-only oracle for HF `generate`).

compressed-tensors: the `compressed-tensors` package packs the codes (`pack_to_int32`) and
writes the config (`QuantizationConfig`), so the layout is the package's, not ours; HF
transformers can load the result itself. fp8 (DeepSeek/Qwen FP8): `float8_e4m3fn` weights with
`weight_scale_inv` per `weight_block_size` block, as DeepSeek-V3's config documents. gptq and awq
(GEMM): our own packers, following AutoGPTQ's and AutoAWQ's published layouts (GPTQ v1: codes
packed down the input columns, zeros stored minus one, `g_idx` per column; AWQ: eight output
columns per word in the order 0,2,4,6,1,3,5,7).
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

_TARGET = re.compile(r"(_proj|_proj_with_mqa|\.w[123])\.weight$")
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


def _pack_words(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes [r, c] -> int32 [r, c * bits / 32], lowest bits first along each row."""
    per = 32 // bits
    q = codes.to(torch.int64).reshape(codes.shape[0], -1, per)
    words = (q << (torch.arange(per) * bits)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


# AWQ GEMM: nibble i of a word holds column AWQ_ORDER[i] of its eight
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _gptq_awq(w: torch.Tensor, method: str, bits: int, group: int | None, symmetric: bool,
              perm: torch.Tensor | None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """GPTQ (v1: zeros stored minus one) or AWQ GEMM tensors of one projection, as AutoGPTQ /
    AutoAWQ document their layouts, and the dequantized weight. `perm`: GPTQ act order (the
    columns in the order their groups are formed)."""
    n, k = w.shape
    g = k if group is None else group
    order = torch.arange(k) if perm is None else perm
    codes, scale, zero, _ = _int_quantize(w[:, order], bits, group, symmetric)  # signed
    offset = 1 << (bits - 1)
    zero_u = (zero.to(torch.int64) if zero is not None
              else torch.zeros_like(scale, dtype=torch.int64)) + offset  # [n, G]
    q_u = torch.empty(n, k, dtype=torch.int64)
    q_u[:, order] = codes.to(torch.int64) + offset  # back in input-column order
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // g).to(torch.int32)
    s = scale.to(torch.float16)
    deq = (q_u - zero_u[:, g_idx.long()]).float() * s.float()[:, g_idx.long()]
    if method == "gptq":  # word (i, j) holds rows per*i .. per*i + per - 1 of column j
        per = 32 // bits
        down = q_u.t().contiguous().view(k // per, per, n).permute(0, 2, 1).reshape(k // per, -1)
        out = {"qweight": _pack_words(down, bits),
               "qzeros": _pack_words(zero_u.t() - 1, bits), "scales": s.t().contiguous(),
               "g_idx": g_idx}
    else:
        cols = q_u.t().contiguous().view(k, n // 8, 8)[..., list(AWQ_ORDER)].reshape(k, n)
        zcols = zero_u.t().contiguous().view(-1, n // 8, 8)[..., list(AWQ_ORDER)]
        out = {"qweight": _pack_words(cols, 4), "qzeros": _pack_words(zcols.reshape(-1, n), 4),
               "scales": s.t().contiguous()}
    return out, deq


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
                    block: tuple[int, int] | None = None, act_order: bool = False
                    ) -> tuple[Path, Path]:
    """Quantize `src`'s projections into `dst` (`method`: "pack" = compressed-tensors
    pack-quantized INT`bits`, "float" = compressed-tensors FP8 per channel, "fp8" = FP8 with
    `block` scales, "gptq" (with `act_order`: a random column order per layer input), "awq")
    and write the dequantized weights as a dense checkpoint to `dequant`. Only "pack" needs
    the compressed-tensors package (benchmarks/gpu_quant.py writes "fp8" and "gptq" where it
    is not installed)."""
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
        if method in ("gptq", "awq"):
            perm = None
            if act_order:  # one order per layer input: q/k/v (and gate/up) share theirs
                gen = torch.Generator().manual_seed(hash(name.rsplit(".", 2)[0]
                                                         .replace("k_proj", "q_proj")
                                                         .replace("v_proj", "q_proj")
                                                         .replace("up_proj", "gate_proj"))
                                                    % 2**31)
                perm = torch.randperm(w.shape[1], generator=gen)
            pieces, deq = _gptq_awq(w, method, bits, group, symmetric, perm)
            out.update({f"{prefix}.{p}": t for p, t in pieces.items()})
        elif method == "pack":
            from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

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
    if method == "gptq":
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": bits,
                                      "group_size": group or -1, "desc_act": act_order,
                                      "sym": symmetric, "checkpoint_format": "gptq"}
    elif method == "awq":
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group,
                                      "zero_point": True, "version": "gemm"}
    elif method == "fp8":
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
