"""build_processor's postprocess sees ray.data.llm's vLLM output field names besides ours."""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from batchgen_data.connectors.ray.llm_compat import VLLM_FIELDS, VllmFieldsThen, with_vllm_fields


def test_vllm_names_carry_our_values() -> None:
    row = {"prompt": "hi", "generated_text": "yo", "generated_token_ids": [4, 5],
           "num_prompt_tokens": 3, "num_generated_tokens": 2, "error": None}
    out = with_vllm_fields(row)
    assert out["generated_tokens"] == [4, 5] and out["num_input_tokens"] == 3
    assert out["prompt"] == "hi" and out["time_taken_llm"] is None
    assert {k: out[k] for k in row} == row  # our own fields unchanged
    assert VllmFieldsThen(lambda r: {"n": r["num_input_tokens"]})(row) == {"n": 3}


def test_names_match_ray_source() -> None:
    """Every field of Ray's vLLMOutputData and the stage's own columns is covered."""
    spec = importlib.util.find_spec("ray")
    if spec is None or spec.origin is None:
        pytest.skip("ray not installed")
    src = Path(spec.origin).parent / "llm/_internal/batch/stages/vllm_engine_stage.py"
    if not src.exists():
        pytest.skip("this Ray has no ray.data.llm vLLM stage")
    tree = ast.parse(src.read_text())
    cls = next(n for n in ast.walk(tree)
               if isinstance(n, ast.ClassDef) and n.name == "vLLMOutputData")
    names = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}
    names |= {"request_id", "batch_uuid", "time_taken_llm", "params"}
    assert "generated_tokens" in names  # the parse found the real class
    ours = {"generated_text", "num_generated_tokens"}  # same name, same meaning already
    assert names - ours <= set(VLLM_FIELDS), sorted(names - ours - set(VLLM_FIELDS))
