"""Bad quantized checkpoints fail with a ValueError naming the tensor or field, before the model
is built (no weight allocated): an unsupported method, format or bit width, a missing or
mis-shaped scale, and a `quantization=` that disagrees with the checkpoint."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from batchgen_data import LLM
from batchgen_data.models import loader
from quant_checkpoints import write_quantized

pytest.importorskip("compressed_tensors")


@pytest.fixture(scope="module")
def int4_dir(tiny_model_dir, tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    base = tmp_path_factory.mktemp("bad-quant")
    return write_quantized(tiny_model_dir("llama"), base / "q", base / "deq", "pack", bits=4,
                           group=32)[0]


@pytest.fixture
def copy(int4_dir: Path, tmp_path: Path, monkeypatch):  # type: ignore[no-untyped-def]
    """A fresh copy of the INT4 checkpoint to break; building a model fails the test."""
    def refuse(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the model was built before the checkpoint was checked")
    monkeypatch.setattr(loader, "build_model", refuse)
    dst = tmp_path / "ckpt"
    shutil.copytree(int4_dir, dst)
    return dst


def _edit_config(path: Path, edit) -> None:  # type: ignore[no-untyped-def]
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg["quantization_config"])
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path: Path, edit) -> None:  # type: ignore[no-untyped-def]
    f = path / "model.safetensors"
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def _weights(qc: dict) -> dict:
    return qc["config_groups"]["group_0"]["weights"]


@pytest.mark.parametrize("edit, words", [
    (lambda qc: qc.update(quant_method="bitsandbytes"), "quant_method='bitsandbytes' is not"),
    (lambda qc: qc.update(format="marlin-24"), "format='marlin-24'"),
    (lambda qc: _weights(qc).update(num_bits=3), "num_bits=3"),
    (lambda qc: _weights(qc).update(actorder="group"), "actorder='group'"),
    (lambda qc: _weights(qc).update(strategy="token"), "strategy='token'"),
    (lambda qc: _weights(qc).update(group_size=0), "group_size=0"),
])
def test_unsupported_config_is_named(copy: Path, edit, words: str) -> None:  # type: ignore[no-untyped-def]
    _edit_config(copy, edit)
    with pytest.raises(ValueError, match=words):
        LLM(str(copy))


def test_missing_scale_names_the_tensor(copy: Path) -> None:
    _edit_tensors(copy, lambda t: t.pop("model.layers.1.mlp.down_proj.weight_scale"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight_scale"):
        LLM(str(copy))


def test_wrong_shaped_scale_names_the_tensor(copy: Path) -> None:
    key = "model.layers.0.self_attn.k_proj.weight_scale"
    _edit_tensors(copy, lambda t: t.update({key: t[key][:, :1].contiguous()}))
    with pytest.raises(ValueError, match=rf"{key.replace('.', '[.]')} has shape"):
        LLM(str(copy))


def test_quantization_argument_is_checked_against_the_checkpoint(copy: Path,
                                                                 tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="disagrees with the checkpoint"):
        LLM(str(copy), quantization="fp8")
    with pytest.raises(ValueError, match="disagrees with the checkpoint"):
        LLM(str(copy), quantization="awq")
    with pytest.raises(ValueError, match="not quantized"):
        LLM(str(tiny_model_dir("llama")), quantization="fp8")
    with pytest.raises(ValueError, match="quantized checkpoints of this method"):
        LLM(str(copy), quantization="bitsandbytes")


def test_fp8_block_scale_of_the_wrong_shape(tiny_model_dir, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    q, _ = write_quantized(tiny_model_dir("llama"), tmp_path / "q", tmp_path / "d", "fp8",
                           block=(16, 32))
    key = "model.layers.0.mlp.up_proj.weight_scale_inv"
    _edit_tensors(q, lambda t: t.update({key: t[key][:-1].contiguous()}))
    monkeypatch.setattr(loader, "build_model", lambda *a, **k: pytest.fail("built"))
    with pytest.raises(ValueError, match=rf"{key.replace('.', '[.]')} has shape"):
        LLM(str(q))
