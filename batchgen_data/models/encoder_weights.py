"""An encoder's weights from its checkpoint: BERT, XLM-RoBERTa and ModernBERT (`bert.py`,
`modernbert.py`), whose HF names map to ours one to one but for the q/k/v projections, fused here
into one `qkv` matrix; a base model saved under a head's prefix is read from under it."""
from __future__ import annotations

import re
from pathlib import Path

from torch import nn

from batchgen_data.models.loader import finalize

_QKV = re.compile(r"\.attention\.self\.(query|key|value)\.(weight|bias)$")
_SHARD = {"query": 0, "key": 1, "value": 2}
_BASE_PREFIXES = ("bert.", "roberta.")
_NOT_OURS = ("cls.", "lm_head.")  # masked-LM heads of a checkpoint used for its encoder


def load_encoder_weights(model: nn.Module, path: Path) -> None:
    """Fill an encoder from the `*.safetensors` in `path` (HF names; q/k/v into `qkv`). A base
    model may name the prefix of its weights in a checkpoint saved with a head
    (`checkpoint_prefixes`, BERT's and RoBERTa's by default) and the heads it skips
    (`foreign_heads`)."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model={str(path)!r}: no *.safetensors files (only safetensors are "
                         "loaded)")
    params = dict(model.named_parameters())
    base = not hasattr(model, "base_prefix")
    prefixes = getattr(model, "checkpoint_prefixes", _BASE_PREFIXES)
    not_ours = getattr(model, "foreign_heads", _NOT_OURS)
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key.endswith("position_ids") or (base and key.startswith(not_ours)):
                    continue
                name = key
                if base and name.startswith(prefixes):
                    name = name.split(".", 1)[1]
                tensor = f.get_tensor(key)
                m = _QKV.search(name)
                if m:
                    target = name[:m.start()] + f".attention.qkv.{m.group(2)}"
                    if target not in params:
                        raise ValueError(f"unexpected weight {key!r} in checkpoint")
                    rows = tensor.shape[0]
                    i = _SHARD[m.group(1)]
                    params[target].data[i * rows:(i + 1) * rows].copy_(tensor)
                    loaded.add(f"{target}#{i}")
                    continue
                if name not in params:
                    if base and name.startswith("pooler."):
                        continue
                    raise ValueError(f"unexpected weight {key!r} in checkpoint")
                params[name].data.copy_(tensor)
                loaded.add(name)
    expected = set()
    for name in params:
        expected |= ({f"{name}#{i}" for i in range(3)} if ".attention.qkv." in name else {name})
    missing = sorted(expected - loaded)
    if base and model.pooler is not None and any(n.startswith("pooler.") for n in missing):
        model.pooler = None  # a checkpoint saved without BERT's pooler: embeddings never use it
        missing = [n for n in missing if not n.startswith("pooler.")]
    if missing:
        raise ValueError(f"checkpoint at {path} lacks weights for {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}")
    del params
    finalize(model)
