"""What a model family is allowed to know: its forward takes the step's tokens, positions, KV
caches and one attention metadata, and nothing about where a micro-batch's KV lives. Checked
over the registry (every generative architecture and the pooling decoders; the encoders keep no
KV cache and take packed lengths instead) and over the imports of every file in `models/`."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest

from batchgen_data.models import registry

MODELS = Path(__file__).resolve().parents[3] / "batchgen_data" / "models"
FORWARD = ["input_ids", "positions", "kv_caches", "attn_metadata"]
# where micro-batches and KV placement live: the runner's and the attention backend's business
PLACEMENT_MODULES = ("batchgen_data.worker", "batchgen_data.layers.micro_batch")
PLACEMENT_NAMES = {"AttentionPart", "split_by_sequences", "in_micro_batches"}


def _decoders() -> dict[str, type]:
    found = {name: registry.resolve_architecture(SimpleNamespace(architectures=[name]))
             for name in registry.supported_architectures()}
    found |= {name: cls for name, cls in registry.pooling_architectures().items()
              if not getattr(cls, "is_encoder", False)}
    return found


def test_the_registry_holds_generative_and_pooling_decoders() -> None:
    found = _decoders()
    assert {"LlamaForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM",
            "Qwen3ForSequenceClassification"} <= set(found)


@pytest.mark.parametrize("name", sorted(_decoders()))
def test_forward_takes_no_placement_argument(name: str) -> None:
    cls = _decoders()[name]
    params = list(inspect.signature(cls.forward).parameters)
    # a vision-language model also takes the step's embeddings with its image rows written in
    extra = ["inputs_embeds"] if getattr(cls, "takes_images", False) else []
    assert params == ["self", *FORWARD, *extra], (name, params)


def placement_imports(source: str) -> list[str]:
    """The imports of `source` that reach micro-batching or KV placement."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            bad += [a.name for a in node.names if a.name.startswith(PLACEMENT_MODULES)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith(PLACEMENT_MODULES):
                bad.append(node.module)
            bad += [f"{node.module}.{a.name}" for a in node.names if a.name in PLACEMENT_NAMES]
    return bad


def test_no_model_imports_the_kv_tier_or_micro_batches() -> None:
    files = sorted(MODELS.glob("*.py"))
    assert len(files) > 10
    found = {f.name: placement_imports(f.read_text()) for f in files}
    assert {name: bad for name, bad in found.items() if bad} == {}


def test_the_import_check_catches_placement() -> None:
    # the check can fail: each way a model could reach the placement machinery is named
    assert placement_imports("from batchgen_data.layers.micro_batch import split_by_sequences")
    assert placement_imports("import batchgen_data.worker.kv_tier.tier")
    assert placement_imports("from batchgen_data.layers.attention import AttentionPart")
    assert not placement_imports("from batchgen_data.layers.attention import Attention")
