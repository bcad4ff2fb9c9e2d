"""Quantized checkpoint tensors -> the stored form of layers/quant.py, one format at a time.

Each quantized module of a checkpoint (HF name `prefix`, e.g. `model.layers.0.self_attn.q_proj`)
holds a few tensors named `prefix.<piece>`; the format says which:
  * compressed-tensors pack-quantized: `weight_packed` int32 [n, ceil(k * bits / 32)] (code i
    at bits [i * bits, (i + 1) * bits) of the row, little-endian, stored as code + 2^(bits-1)),
    `weight_scale` [n, G], `weight_shape` [2] = (n, k), and for asymmetric schemes
    `weight_zero_point`, packed the same way along the rows: int32 [ceil(n * bits / 32), G];
  * compressed-tensors int-quantized: `weight` int8 [n, k], `weight_scale`, `weight_zero_point`;
  * compressed-tensors float-quantized: `weight` float8_e4m3fn [n, k], `weight_scale` [1] or []
    (tensor), [n, 1] (channel) or [ceil(n / b0), ceil(k / b1)] (block);
  * fp8 (DeepSeek-V3 / Qwen3 FP8): `weight` float8_e4m3fn [n, k], `weight_scale_inv`
    [ceil(n / b0), ceil(k / b1)] for `weight_block_size` [b0, b1] (w = fp8 * scale_inv), or a
    per-tensor `weight_scale`.
  * gptq: `qweight` int32 [k * bits / 32, n], codes packed down the input columns (lowest bits
    first), `qzeros` int32 [G, n * bits / 32] packed along the rows (v1 checkpoints store
    zero - 1), `scales` [G, n], `g_idx` [k] (the group of each input column; with `desc_act`
    not k // group_size: the columns are then stored sorted by group and the layer permutes
    its input the same way);
  * awq (GEMM): `qweight` int32 [k, n / 8], eight rows per word in the order 0,2,4,6,1,3,5,7,
    `qzeros` [G, n / 8] packed the same way, `scales` [G, n]; w = (q - z) * s.
`input_scale` (static activation scales) is read past: activations stay unquantized here.

`scan` reads only the safetensors headers, so every missing or mis-shaped piece is a ValueError
naming the tensor before the model is built; `Collector` gathers a module's pieces while the
loader streams the files and converts them once the module is complete.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from batchgen_data.layers.quant import QuantWeight
from batchgen_data.models.quant_config import CheckpointQuant

# a tensor of a quantized module: name suffix after "<prefix>."
_PIECES = ("weight_packed", "weight_scale", "weight_scale_inv", "weight_zero_point",
           "weight_shape", "weight", "input_scale", "qweight", "qzeros", "scales", "g_idx")
# a module with one is quantized
_MARKERS = ("weight_packed", "weight_scale", "weight_scale_inv", "qweight")
_AWQ_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)  # AWQ packs columns 0,2,4,6,1,3,5,7 into nibbles 0..7
_IGNORED = ("input_scale",)
Shapes = dict[str, tuple[tuple[int, ...], str]]  # piece -> (shape, safetensors dtype)


def _split(key: str) -> tuple[str, str] | None:
    prefix, _, piece = key.rpartition(".")
    return (prefix, piece) if prefix and piece in _PIECES else None


def _required(cq: CheckpointQuant) -> tuple[str, ...]:
    if cq.method in ("gptq", "awq"):  # zeros are stored even for symmetric GPTQ
        return ("qweight", "qzeros", "scales") + (("g_idx",) if cq.act_order else ())
    if cq.format == "pack-quantized":
        need = ("weight_packed", "weight_scale", "weight_shape")
    elif cq.method == "fp8":
        need = ("weight", "weight_scale_inv" if cq.block else "weight_scale")
    else:
        need = ("weight", "weight_scale")
    return need + (() if cq.scheme.symmetric else ("weight_zero_point",))


@dataclass
class QuantPlan:
    """The quantized modules of a checkpoint: HF prefix -> (n, k)."""

    quant: CheckpointQuant
    modules: dict[str, tuple[int, int]] = field(default_factory=dict)

    def is_piece(self, key: str) -> bool:
        split = _split(key)
        return split is not None and split[0] in self.modules


def scan(path: Path, cq: CheckpointQuant) -> QuantPlan:
    """Reads the checkpoint's headers; ValueError naming the tensor for a missing or
    mis-shaped piece of a quantized module, or when no module is quantized."""
    from safetensors import safe_open

    found: dict[str, Shapes] = {}
    shape_of: dict[str, tuple[int, ...]] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                split = _split(key)
                if split is not None:
                    sl = f.get_slice(key)
                    found.setdefault(split[0], {})[split[1]] = (tuple(sl.get_shape()),
                                                                sl.get_dtype())
                    if split[1] == "weight_shape":  # two ints: the exact (n, k) of a packing
                        shape_of[split[0]] = tuple(int(v) for v in f.get_tensor(key).tolist())
    plan = QuantPlan(cq)
    for prefix, shapes in found.items():
        if any(m in shapes for m in _MARKERS):
            plan.modules[prefix] = check_shapes(cq, prefix, shapes, shape_of.get(prefix))
    if not plan.modules:
        raise ValueError(f"checkpoint at {path} says quant_method={cq.method!r} but no tensor "
                         f"has a quantization scale ({', '.join(_MARKERS)})")
    return plan


def check_shapes(cq: CheckpointQuant, prefix: str, shapes: Shapes,
                 weight_shape: tuple[int, ...] | None = None) -> tuple[int, int]:
    """(n, k) of a quantized module from its pieces' shapes (and, packed, the values of its
    `weight_shape`); ValueError naming the piece."""
    for piece in _required(cq):
        if piece not in shapes:
            raise ValueError(f"checkpoint lacks {prefix}.{piece} ({cq.method} {cq.format}, "
                             f"{cq.scheme})")
    scheme = cq.scheme
    bits = {"int4": 4, "int8": 8, "fp8": 8}[scheme.kind]
    if cq.method in ("gptq", "awq"):
        return _check_gptq_awq(cq, prefix, shapes, bits)
    if cq.format == "pack-quantized":
        shape_of = shapes["weight_shape"][0]
        if shape_of != (2,):
            raise ValueError(f"{prefix}.weight_shape has shape {shape_of}, want (2,)")
        packed, dtype = shapes["weight_packed"]
        if dtype != "I32" or len(packed) != 2:
            raise ValueError(f"{prefix}.weight_packed is {dtype} {packed}; want int32 [n, words]")
        if weight_shape is None or len(weight_shape) != 2:
            raise ValueError(f"{prefix}.weight_shape holds {weight_shape}; want (n, k)")
        n, k = weight_shape
        if packed != (n, -(-k * bits // 32)):
            raise ValueError(f"{prefix}.weight_packed has shape {packed}; want "
                             f"({n}, {-(-k * bits // 32)}) for a weight of [{n}, {k}] in "
                             f"{bits} bits")
    else:
        weight, dtype = shapes["weight"]
        want = "F8_E4M3" if scheme.kind == "fp8" else "I8"
        if dtype != want or len(weight) != 2:
            raise ValueError(f"{prefix}.weight is {dtype} {weight}; want {want} [n, k]")
        n, k = weight
    _check_scale(cq, prefix, shapes, n, k)
    if not scheme.symmetric:
        zp = shapes["weight_zero_point"][0]
        groups = scheme.groups(k)
        rows = -(-n * bits // 32) if cq.format == "pack-quantized" else n
        if zp != (rows, groups):
            raise ValueError(f"{prefix}.weight_zero_point has shape {zp}; want "
                             f"({rows}, {groups})")
    return n, k


def _check_gptq_awq(cq: CheckpointQuant, prefix: str, shapes: Shapes, bits: int
                    ) -> tuple[int, int]:
    """GPTQ: qweight int32 [k * bits / 32, n] (packed down the input columns), qzeros int32
    [G, n * bits / 32], scales [G, n], g_idx [k]. AWQ: qweight int32 [k, n / 8] (packed along
    the output rows), qzeros [G, n / 8], scales [G, n]."""
    per = 32 // bits
    (rows, cols), dtype = shapes["qweight"]
    if dtype != "I32":
        raise ValueError(f"{prefix}.qweight is {dtype}; want int32")
    n, k = (cols, rows * per) if cq.method == "gptq" else (cols * per, rows)
    groups = cq.scheme.groups(k)
    want = {"scales": (groups, n), "qzeros": (groups, n // per)}
    if cq.act_order or "g_idx" in shapes:
        want["g_idx"] = (k,)
    for piece, shape in want.items():
        if piece in shapes and shapes[piece][0] != shape:
            raise ValueError(f"{prefix}.{piece} has shape {shapes[piece][0]}; want {shape} for "
                             f"a weight of [{n}, {k}] ({cq.method}, {cq.scheme})")
    return n, k


def _check_scale(cq: CheckpointQuant, prefix: str, shapes: Shapes, n: int, k: int) -> None:
    piece = "weight_scale_inv" if "weight_scale_inv" in _required(cq) else "weight_scale"
    got = shapes[piece][0]
    if cq.block is not None:
        want = (-(-n // cq.block[0]), -(-k // cq.block[1]))
        ok = got == want
    elif cq.scheme.kind == "fp8":
        want = "(), (1,), (n,) or (n, 1)"
        ok = got in ((), (1,), (n,), (n, 1))
    elif cq.scheme.group_size is None:
        want, ok = (n, 1), got == (n, 1)
    else:
        want = (n, cq.scheme.groups(k))
        ok = got == want
    if not ok:
        raise ValueError(f"{prefix}.{piece} has shape {got}; want {want} for a weight of "
                         f"[{n}, {k}] ({cq.scheme}{', block ' + str(cq.block) if cq.block else ''})")


def _unpack_bytes(packed: torch.Tensor) -> torch.Tensor:
    """The bytes of int32 words [r, w] in memory order -> uint8 [r, 4w] (little-endian)."""
    assert sys.byteorder == "little", "packed checkpoints are read on little-endian hosts"
    return packed.contiguous().view(torch.uint8)


def _expand_rows(scale: torch.Tensor, n: int, k: int, cq: CheckpointQuant) -> torch.Tensor:
    """A checkpoint's scale tensor -> fp32 [n, G] per row (block and tensor scales repeated)."""
    s = scale.float()
    if cq.block is not None:
        return s.repeat_interleave(cq.block[0], dim=0)[:n].contiguous()
    if s.numel() == 1:
        return s.reshape(1, 1).expand(n, 1).contiguous()
    return s.reshape(n, -1).contiguous()


def _nibbles(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [r, c] -> [r, c, 32 / bits] codes, lowest bits first."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return (words[..., None] >> shifts) & ((1 << bits) - 1)


def _pack_codes(q: torch.Tensor, kind: str) -> torch.Tensor:
    """Unsigned codes [n, k] (0..2^bits - 1) -> the stored form's codes."""
    if kind == "int4":
        q = torch.nn.functional.pad(q, (0, q.shape[1] % 2))
        return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8).contiguous()
    return (q - 128).to(torch.int8).contiguous()


def _convert_gptq_awq(cq: CheckpointQuant, prefix: str, pieces: dict[str, torch.Tensor]
                      ) -> QuantWeight:
    scheme = cq.scheme
    bits = 4 if scheme.kind == "int4" else 8
    shapes = {p: (tuple(t.shape), _st_dtype(t)) for p, t in pieces.items()}
    n, k = _check_gptq_awq(cq, prefix, shapes, bits)
    if cq.method == "gptq":  # [k / per, per, n] -> [n, k]
        q = _nibbles(pieces["qweight"].t(), bits).reshape(n, k)
        zeros = _nibbles(pieces["qzeros"], bits).reshape(-1, n) + cq.zero_offset  # [G, n]
    else:
        order = list(_AWQ_COLUMN)
        q = _nibbles(pieces["qweight"], bits)[..., order].reshape(k, n).t()
        zeros = _nibbles(pieces["qzeros"], bits)[..., order].reshape(-1, n)
    scale = pieces["scales"].float().t().contiguous()  # [n, G]
    zero: torch.Tensor | None = zeros.t().float().contiguous()
    offset = 1 << (bits - 1)
    if scheme.symmetric:
        if not bool((zeros == offset).all()):
            raise ValueError(f"{prefix}.qzeros: sym=True, but the zeros are not all {offset}")
        zero = None
    elif scheme.kind == "int8":
        zero = zero - offset  # the stored codes are signed
    perm = None
    g_idx = pieces.get("g_idx")
    if g_idx is not None:
        g = scheme.group(k)
        g_idx = g_idx.long()
        if not torch.equal(g_idx, torch.arange(k) // g):
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], torch.arange(k) // g):
                raise ValueError(f"{prefix}.g_idx: groups of other than group_size={g} "
                                 "columns")
            q = q[:, perm]
    return QuantWeight(scheme, k, _pack_codes(q, scheme.kind), scale, zero, perm)


def convert(cq: CheckpointQuant, prefix: str, pieces: dict[str, torch.Tensor]) -> QuantWeight:
    """One quantized module's tensors -> its stored form."""
    scheme = cq.scheme
    if cq.method in ("gptq", "awq"):
        return _convert_gptq_awq(cq, prefix, pieces)
    if cq.format == "pack-quantized":
        n, k = (int(v) for v in pieces["weight_shape"].tolist())
        check_shapes(cq, prefix, {p: (tuple(t.shape), _st_dtype(t)) for p, t in pieces.items()},
                     (n, k))
        raw = _unpack_bytes(pieces["weight_packed"])
        if scheme.kind == "int4":  # bytes already hold two (code + 8)s, low nibble first
            codes = raw[:, :-(-k // 2)].contiguous()
        else:  # (code + 128) -> the signed code
            codes = (raw[:, :k] ^ 0x80).view(torch.int8).contiguous()
        zero = None
        if not scheme.symmetric:
            zb = _unpack_bytes(pieces["weight_zero_point"].t().contiguous())  # [G, bytes]
            if scheme.kind == "int4":
                u = torch.stack((zb & 15, zb >> 4), dim=-1).reshape(zb.shape[0], -1)[:, :n]
                zero = u.t().float().contiguous()  # zp + 8, as the codes
            else:
                zero = (zb[:, :n].to(torch.int16) - 128).t().float().contiguous()
        return QuantWeight(scheme, k, codes, pieces["weight_scale"].float().reshape(n, -1)
                           .contiguous(), zero)
    weight = pieces["weight"]
    n, k = weight.shape
    check_shapes(cq, prefix, {p: (tuple(t.shape), _st_dtype(t)) for p, t in pieces.items()})
    scale = pieces["weight_scale_inv" if cq.method == "fp8" and cq.block else "weight_scale"]
    codes = weight.contiguous().view(torch.uint8 if scheme.kind == "fp8" else torch.int8)
    zero = None if scheme.symmetric else pieces["weight_zero_point"].float().reshape(n, -1)
    return QuantWeight(scheme, k, codes, _expand_rows(scale, n, k, cq), zero)


_ST_DTYPES = {torch.int32: "I32", torch.int8: "I8", torch.float8_e4m3fn: "F8_E4M3",
              torch.int64: "I64"}


def _st_dtype(t: torch.Tensor) -> str:
    return _ST_DTYPES.get(t.dtype, str(t.dtype))


class Collector:
    """Gathers each quantized module's pieces as the loader meets them; `add` returns the
    module's `QuantWeight` (with its HF weight name) once its last piece has arrived."""

    def __init__(self, plan: QuantPlan) -> None:
        self.plan = plan
        self._need = set(_required(plan.quant))
        self._parts: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, key: str, tensor: torch.Tensor) -> tuple[str, QuantWeight] | None:
        prefix, piece = _split(key)  # type: ignore[misc]  # is_piece(key) was True
        if piece in _IGNORED:
            return None
        parts = self._parts.setdefault(prefix, {})
        parts[piece] = tensor
        if not self._need <= set(parts):
            return None
        del self._parts[prefix]
        return f"{prefix}.weight", convert(self.plan.quant, prefix, parts)

    def unfinished(self) -> list[str]:
        return sorted(self._parts)
