"""abort, hold/resume (with and without host KV), the typed load report and the movable
requests, the decode seam for runner benchmarks, bad inputs at the offline API."""
from __future__ import annotations

import copy

import pytest

from batchgen_data import LLM, SamplingParams
from batchgen_data.placement import EngineLoad
from engine_seams import schedule_decode, watch_steps


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
    assert (e.live.held[rid].seqs[0].held_kv is not None) == keep_kv
    done = drain(e)
    assert other in done and rid not in done  # a held request does not run
    e.resume(rid)
    assert drain(e)[rid].outputs[0].token_ids == ref.token_ids


def test_reset_prefix_cache_forgets_cached_prompts(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """vLLM's `LLM.reset_prefix_cache`: a prompt run again hits the prefix cache, and after a
    reset it is computed again, with the same tokens."""
    llm = LLM(str(tiny_model_dir("qwen3")), max_model_len=256, block_size=4)
    prompt = [{"prompt_token_ids": list(range(5, 30))}]  # six full blocks
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    again = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 24
    assert llm.reset_prefix_cache() is True
    reset = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert reset.num_cached_tokens == 0
    assert reset.outputs[0].token_ids == first.outputs[0].token_ids


def test_load_and_movable_report_what_could_move(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    e = LLM(str(tiny_model_dir("qwen3")), max_model_len=256, max_num_seqs=2).engine
    rids = [e.submit([5 + i, 6, 7, 8], GREEDY) for i in range(4)]
    e.step()  # two prefills: each has sampled one token; two wait for a seat
    ld = e.load("e0")
    assert isinstance(ld, EngineLoad)
    assert (ld.engine_id, ld.waiting, ld.running, ld.held) == ("e0", 2, 2, 0)
    assert (ld.max_num_seqs, ld.block_size) == (2, e.config.cache.block_size)
    # running: 1 pending + 15 tokens still allowed; waiting: 4 pending + 16 allowed
    assert ld.remaining_tokens_est == 2 * 16 + 2 * 20
    assert ld.kv_bytes_per_token > 0 and ld.free_blocks < ld.total_blocks
    e.hold(rids[0])
    ld = e.load()
    assert (ld.waiting, ld.running, ld.held) == (2, 1, 1)
    kinds = [(r.request_id, r.kind) for r in e.movable()]
    assert kinds == [(rids[2], "waiting"), (rids[3], "waiting"), (rids[1], "running")]
    assert rids[2] not in {r.request_id for r in e.movable(exclude={rids[2]})}
    assert not e.is_live(rids[0]) and e.is_live(rids[1])  # held by the user: not live
    assert e.num_unfinished() == 3 and e.num_unfinished(exclude={rids[1]}) == 2
    e.resume(rids[0])
    assert len(drain(e)) == 4


def test_decode_seam_leaves_the_engine_consistent(llm: LLM,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    e = llm.engine
    prompts = [[7, 8, 9], [10, 11, 12, 13, 14]]
    ref = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    rids = [e.submit(p, GREEDY) for p in prompts]
    with monkeypatch.context() as m:
        shapes = watch_steps(e, m)
        computed = e.stats.computed_tokens
        out = schedule_decode(e)  # what a runner benchmark times
        shapes.pop()  # the decode scheduled here, and again by the next step
        assert out.num_new_tokens == [1, 1] and [s.request_id for s in out.seqs] == rids
        e.runner.run(e.runner.prepare(out))  # the benchmark runs it; the engine does not know
        done = drain(e)
    assert [done[r].outputs[0].token_ids for r in rids] == [o.outputs[0].token_ids for o in ref]
    assert sum(s.num_new_tokens for s in shapes) == e.stats.computed_tokens - computed
    assert shapes[0].num_new_tokens == 3 + 5 and shapes[0].kv_tokens == 3 + 5  # the prefills
    assert shapes[-1].kv_tokens >= shapes[-1].num_seqs == 2


def test_shipped_kv_that_does_not_fit_is_recomputed(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    path = str(tiny_model_dir("qwen3"))
    src = LLM(path, max_model_len=256)
    ref = src.generate([{"prompt_token_ids": [9, 8, 7, 6]}], GREEDY, use_tqdm=False)[0]
    rid = src.engine.submit([9, 8, 7, 6], GREEDY)
    for _ in range(4):
        src.engine.step()
    state = src.engine.export(rid, include_kv=True)
    context = len(state["prompt_token_ids"]) + len(state["seqs"][0]["output_token_ids"])
    for host_bytes, kept in [(1 << 30, context - 1), (0, 0)]:  # 0: no room in the host tier
        dst = LLM(path, max_model_len=256, held_kv_bytes=host_bytes).engine
        dst.import_(copy.deepcopy(state))
        [summary] = dst.movable()
        assert (summary.kind, summary.num_computed_tokens) == ("waiting", kept)
        assert drain(dst)[rid].outputs[0].token_ids == ref.outputs[0].token_ids


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
    (42, TypeError, "prompt must be a string"),
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
