"""abort, hold/resume (with and without host KV), bad inputs at the offline API."""
from __future__ import annotations

import pytest

from batchgen_data import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:  # type: ignore[no-untyped-def]
    return LLM(str(tiny_model_dir("qwen3")), max_model_len=256)


GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def drain(engine) -> dict:  # type: ignore[no-untyped-def]
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] = o
    return out


@pytest.mark.parametrize("keep_kv", [True, False])
def test_hold_and_resume_keep_tokens(llm: LLM, keep_kv: bool) -> None:
    e = llm.engine
    prompt = [7, 8, 9, 10, 11, 12]
    ref = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0].outputs[0]
    rid = e.submit(prompt, GREEDY)
    other = e.submit([3, 4, 5], GREEDY)
    for _ in range(5):
        e.step()
    free_before = e.pool.num_free
    e.hold(rid, keep_kv=keep_kv)
    assert e.pool.num_free > free_before  # its GPU blocks were released
    assert (e.parked[rid].seqs[0].host_kv is not None) == keep_kv
    done = drain(e)
    assert other in done and rid not in done  # a held request does not run
    e.resume(rid)
    assert drain(e)[rid].outputs[0].token_ids == ref.token_ids


def test_abort_reports_and_frees(llm: LLM) -> None:
    e = llm.engine
    rid = e.submit([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    e.step()
    assert e.abort(rid)
    out = drain(e)[rid]
    assert out.outputs[0].finish_reason == "abort"
    assert e.pool.num_free == e.pool.num_blocks and not e.abort(rid)


@pytest.mark.parametrize("prompt,exc,match", [
    ("", ValueError, "empty"),
    ({"prompt_token_ids": []}, ValueError, "empty"),
    ({"prompt_token_ids": [1] * 300}, ValueError, "max_model_len"),
    ({"prompt_token_ids": [10 ** 9]}, ValueError, "prompt_token_ids"),
    (42, TypeError, "prompt must be str"),
    ({"text": "x"}, ValueError, "prompt"),
])
def test_bad_prompts_raise_before_running(llm: LLM, prompt, exc, match) -> None:  # type: ignore[no-untyped-def]
    steps = llm.engine.stats.num_steps
    with pytest.raises(exc, match=match):
        llm.generate(["fine prompt", prompt], GREEDY, use_tqdm=False)
    assert llm.engine.stats.num_steps == steps and not llm.engine.has_unfinished()


def test_bad_engine_arguments(tiny_model_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(str(tiny_model_dir("llama")), max_num_seq=4)
    with pytest.raises(ValueError, match="model="):
        LLM(str(tmp_path / "nowhere"))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(str(tmp_path))
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(tiny_model_dir("llama")), block_size=12)


def test_chat_uses_template(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "hello"}], GREEDY, use_tqdm=False)[0]
    assert out.prompt.startswith("<|im_start|>user") and out.prompt.endswith("assistant\n")
    with pytest.raises(ValueError, match="messages"):
        llm.chat([{"role": "user"}], GREEDY, use_tqdm=False)
