"""How a model directory pools: its sentence-transformers modules when it has them, else vLLM's
defaults (decoders: the last token; encoders: the CLS token; embeddings normalised).

A sentence-transformers directory lists its pipeline in `modules.json`: the Transformer (the
checkpoint at the root), a `Pooling` module whose `config.json` names the mode
(`pooling_mode_cls_token`, `pooling_mode_mean_tokens`, `pooling_mode_lasttoken`), and an
optional `Normalize`. Modules this engine does not run (a `Dense` projection, max or weighted
pooling) are refused with their name rather than silently skipped: the embeddings would differ.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from batchgen_data.layers.pooler import PoolerConfig, PoolingType

_ST = "sentence_transformers.models."
_MODES = {"pooling_mode_cls_token": PoolingType.CLS, "pooling_mode_mean_tokens": PoolingType.MEAN,
          "pooling_mode_lasttoken": PoolingType.LAST}
_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                      "pooling_mode_weightedmean_tokens")


def default_pooler(is_encoder: bool) -> PoolerConfig:
    return PoolerConfig(PoolingType.CLS if is_encoder else PoolingType.LAST, normalize=True)


def read_pooler_config(path: Path, is_encoder: bool) -> PoolerConfig:
    modules_file = path / "modules.json"
    if not modules_file.exists():
        return default_pooler(is_encoder)
    modules: list[dict[str, Any]] = json.loads(modules_file.read_text())
    kind = None
    normalize = False
    for m in modules:
        mtype = str(m.get("type", ""))
        short = mtype.removeprefix(_ST)
        if short == "Transformer":
            continue
        if short == "Normalize":
            normalize = True
        elif short == "Pooling":
            kind = _pooling_mode(path / m.get("path", ""))
        else:
            raise ValueError(f"{modules_file}: module {mtype!r} is not supported (only "
                             "Transformer, Pooling and Normalize)")
    if kind is None:
        raise ValueError(f"{modules_file}: no Pooling module")
    return PoolerConfig(kind, normalize)


def _pooling_mode(folder: Path) -> PoolingType:
    cfg = json.loads((folder / "config.json").read_text())
    mode = cfg.get("pooling_mode")
    if isinstance(mode, str):  # newer sentence-transformers: one name
        named = {"cls": PoolingType.CLS, "mean": PoolingType.MEAN, "lasttoken": PoolingType.LAST}
        if mode not in named:
            raise ValueError(f"{folder}/config.json: pooling_mode={mode!r} is not supported")
        return named[mode]
    on = [k for k in (*_MODES, *_UNSUPPORTED_MODES) if cfg.get(k)]
    if len(on) != 1 or on[0] not in _MODES:
        raise ValueError(f"{folder}/config.json: pooling {on!r} is not supported (one of "
                         f"{sorted(_MODES)})")
    if cfg.get("include_prompt") is False:
        raise ValueError(f"{folder}/config.json: include_prompt=false is not supported")
    return _MODES[on[0]]


def matryoshka_dimensions(hf_config: Any) -> list[int] | None | bool:
    """The dimensions a Matryoshka model allows: a list, True for any, None when it is not one."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        return list(dims)
    return True if getattr(hf_config, "is_matryoshka", False) else None
