"""Ray's `python/ray/llm/tests/batch` public-behaviour tests, ported to `build_processor` and
`BatchGenProcessorConfig` (each test names its upstream test).

Ported: `cpu/processor/test_processor_base.py::test_empty_processor` (a preprocess's output is
merged into the row; the postprocess's output is the row), `gpu/processor/
test_vllm_engine_proc.py::test_generation_model` (on a tiny random Llama on the CPU, without
`accelerator_type`), and `cpu/processor/test_backward_compat.py` (the stage configs and legacy
flags: Ray's tests read its internal stage dicts, these read what the flags do here). Ray's
typed stage configs cannot be imported without `aiohttp`, so a pydantic stand-in with Ray's
`ChatTemplateStageConfig` fields plays them. Not ported: custom stages and the
`ProcessorBuilder` registry (no stage chain here), `test_embedding_model` (pooling rows take
`prompt`/`text`, not chat messages: docs/ray_data.md lists it), multimodal (the image rows
are tests/unit/connectors/test_image_rows.py).
"""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

ray = pytest.importorskip("ray")
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers run its lambdas

from batchgen_data.connectors.ray_data import (  # noqa: E402
    BatchGenProcessorConfig, build_processor)

pytestmark = pytest.mark.timeout(300)
ENGINE = {"max_model_len": 1024, "max_num_seqs": 16}


@pytest.fixture(scope="module")
def model(tiny_model_dir: Any) -> str:
    return str(tiny_model_dir("llama"))


class ChatTemplateStageConfig(BaseModel):
    """Ray's `ray.llm._internal.batch.stages.configs.ChatTemplateStageConfig` fields."""

    enabled: bool = True
    batch_size: int | None = None
    concurrency: int | tuple[int, int] | None = None
    runtime_env: dict[str, Any] | None = None
    num_cpus: float | None = None
    memory: float | None = None
    model_source: str | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# ---- cpu/processor/test_backward_compat.py ----------------------------------------------------
def test_legacy_booleans_coerced_to_stage_configs() -> None:
    """Upstream: apply_chat_template=True, tokenize=False, detokenize=True → stage configs."""
    config = BatchGenProcessorConfig(model_source=None, apply_chat_template=True,
                                     tokenize=False, detokenize=True)
    assert config.chat_template_on is True
    assert config.detokenize_on is True
    assert config.constructor_kwargs()["apply_chat_template"] is True


def test_explicit_stage_configs_preserved() -> None:
    """Upstream: an explicit chat_template_stage wins over the legacy apply_chat_template."""
    explicit = ChatTemplateStageConfig(enabled=False, batch_size=64)
    config = BatchGenProcessorConfig(model_source=None, chat_template_stage=explicit,
                                     apply_chat_template=True)
    assert config.chat_template_stage is explicit
    assert config.chat_template_on is False
    assert config.constructor_kwargs()["apply_chat_template"] is False


def test_chat_template_fields_merged() -> None:
    """Upstream: apply_chat_template + chat_template → the template is the one used."""
    config = BatchGenProcessorConfig(model_source=None, apply_chat_template=True,
                                     chat_template="custom_template")
    assert config.chat_template_on is True
    assert config.constructor_kwargs()["chat_template"] == "custom_template"
    staged = BatchGenProcessorConfig(chat_template_stage={"chat_template": "staged",
                                                          "chat_template_kwargs": {"x": 1}},
                                     chat_template="legacy")
    assert staged.template_options == ("staged", {"x": 1})


def test_no_warnings_when_using_new_api() -> None:
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        BatchGenProcessorConfig(model_source=None,
                                chat_template_stage=ChatTemplateStageConfig(enabled=True),
                                tokenize_stage={"enabled": True},
                                detokenize_stage={"enabled": True},
                                prepare_multimodal_stage={"enabled": False})
    assert not [x for x in w if issubclass(x.category, UserWarning)]


def test_legacy_dict_stage_config() -> None:
    config = BatchGenProcessorConfig(model_source=None,
                                     chat_template_stage={"enabled": False, "batch_size": 128},
                                     tokenize_stage={"enabled": True, "concurrency": 4})
    assert config.chat_template_stage == {"enabled": False, "batch_size": 128}
    assert config.tokenize_stage == {"enabled": True, "concurrency": 4}
    assert config.chat_template_on is False


@pytest.mark.parametrize("legacy_field", ["has_image", "prepare_image_stage"])
def test_removed_legacy_fields_rejected(legacy_field: str) -> None:
    """Upstream: pydantic's ValidationError (a ValueError); here a ValueError with the reason."""
    with pytest.raises(ValueError, match=f"{legacy_field}: removed from ray.data.llm"):
        BatchGenProcessorConfig(model_source=None, **{legacy_field: True})


@pytest.mark.parametrize("kwargs, match", [
    ({"prepare_multimodal_stage": {"chat_template_content_fmt": "openai"}}, "unknown field"),
    ({"log_engine_metrics": False}, "always exported"),
    ({"tokenize_stage": {"model_source": "other/model"}}, "own model's tokenizer"),
    ({"detokenize_stage": {"batch_sizes": 3}}, "unknown field"),
    ({"max_pending_requests": 0}, "max_pending_requests"),
])
def test_fields_that_cannot_mean_the_same_are_refused_by_name(kwargs: dict[str, Any],
                                                              match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BatchGenProcessorConfig(model_source=None, **kwargs)


def test_every_field_of_rays_config_is_a_field_here() -> None:
    """vLLMEngineProcessorConfig's fields (and its bases') in the installed Ray, read from its
    source, are all accepted by name (with their meaning, or refused with a reason)."""
    spec = importlib.util.find_spec("ray")
    assert spec is not None and spec.origin is not None
    root = Path(spec.origin).parent / "llm/_internal/batch/processor"
    names: set[str] = set()
    for src, classes in (("base.py", {"ProcessorConfig", "OfflineProcessorConfig"}),
                         ("vllm_engine_proc.py", {"vLLMEngineProcessorConfig"})):
        tree = ast.parse((root / src).read_text())
        for cls in ast.walk(tree):
            if isinstance(cls, ast.ClassDef) and cls.name in classes:
                names |= {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}
    assert {"model_source", "tokenize_stage", "engine_kwargs"} <= names  # the parse worked
    ours = {f.name for f in dataclasses.fields(BatchGenProcessorConfig)}
    assert names <= ours, sorted(names - ours)


def test_max_pending_requests_bounds_the_rows_in_an_engine() -> None:
    config = BatchGenProcessorConfig(batch_size=16, max_pending_requests=40)
    assert config.concurrent_batches == 2  # whole batches, 32 rows <= 40


def test_builder_kwargs_chat_template_kwargs() -> None:
    config = BatchGenProcessorConfig(model_source=None)
    processor = build_processor(config, builder_kwargs={"chat_template_kwargs": {"a": 1}})
    assert processor.config.constructor_kwargs()["chat_template_kwargs"] == {"a": 1}
    with pytest.raises(ValueError, match="preprocess"):
        build_processor(config, builder_kwargs={"preprocess": None})


# ---- runs on a local Ray -----------------------------------------------------------------------
def test_empty_processor(ray_local: None, model: str) -> None:
    """Upstream test_empty_processor: preprocess {id} -> {id, val}, postprocess -> {id, result}.
    The engine sits between them here, so the preprocess also gives the row a prompt."""
    config = BatchGenProcessorConfig(model_source=model, batch_size=64, concurrency=1,
                                     engine_kwargs=ENGINE, sampling_params={"max_tokens": 2})
    processor = build_processor(
        config,
        preprocess=lambda row: {"val": row["id"] + 5, "prompt": f"Count to {row['id']}"},
        postprocess=lambda row: {"result": row["val"], "id": row["id"]})
    ds = processor(ray.data.range(5)).take_all()
    assert len(ds) == 5
    for row in ds:
        assert "val" not in row
        assert "id" in row
        assert "result" in row
        assert row["result"] == row["id"] + 5  # the merged row kept its id


CHATML_WITH_CHECKS = """
{% if messages[0]['role'] == 'system' %}
    {% set offset = 1 %}
{% else %}
    {% set offset = 0 %}
{% endif %}

{{ bos_token }}
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == offset) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}

    {{ '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}
{% endfor %}

{% if add_generation_prompt %}
    {{ '<|im_start|>assistant\\n' }}
{% endif %}
    """


def test_generation_model(ray_local: None, model: str) -> None:
    """Upstream test_generation_model (gpu/processor/test_vllm_engine_proc.py): 60 rows, a
    custom chat template, `detokenize=False` in the rows' sampling_params with Ray's detokenize
    stage on (so every row still gets its text). Without accelerator_type (CPU), max_model_len
    at the tiny model's 1024 positions; the postprocess also returns the tokens, so the text can
    be checked against them."""
    from transformers import AutoTokenizer

    config = BatchGenProcessorConfig(
        model_source=model,
        engine_kwargs=dict(enable_prefix_caching=False, enable_chunked_prefill=True,
                           max_num_batched_tokens=2048, max_model_len=1024, enforce_eager=True),
        batch_size=16, concurrency=1, apply_chat_template=True,
        chat_template=CHATML_WITH_CHECKS, tokenize=True, detokenize=True)
    processor = build_processor(
        config,
        preprocess=lambda row: dict(
            messages=[{"role": "system", "content": "You are a calculator"},
                      {"role": "user", "content": f"{row['id']} ** 3 = ?"}],
            sampling_params=dict(temperature=0.3, max_tokens=50, detokenize=False)),
        postprocess=lambda row: {"resp": row["generated_text"], "tokens": row["generated_tokens"]})
    ds = ray.data.range(60)
    ds = ds.map(lambda x: {"id": x["id"], "val": x["id"] + 5})
    ds = processor(ds)
    ds = ds.materialize()
    outs = ds.take_all()
    assert len(outs) == 60
    assert all("resp" in out for out in outs)
    tok = AutoTokenizer.from_pretrained(model)
    assert any(out["resp"] for out in outs)
    for out in outs:  # Ray's detokenize stage: the text of the generated tokens
        assert out["resp"] == tok.decode(list(out["tokens"]), skip_special_tokens=True)
