"""async_scheduling=True (step n+1 scheduled and prepared while step n runs, docs/step.md) gives
every request what the synchronous engine gives it: greedy and seeded tokens, n > 1, stop ids
and strings, min_tokens, logprobs, rows joining mid-run, preemption, abort mid-flight; and most
steps do overlap. (Greedy against HF with async_scheduling: tests/integration/
test_engine_vs_hf.py.)"""
from __future__ import annotations

import pytest

from batchgen_data import LLM, SamplingParams

STOP_IDS = list(range(40, 70))  # a random model samples one of these every ~10 tokens


def params(vocab: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=3, n=2, max_tokens=15),
        SamplingParams(temperature=0.9, seed=11, max_tokens=25, stop_token_ids=STOP_IDS,
                       min_tokens=4),
        SamplingParams(temperature=0.7, seed=5, max_tokens=18, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=2, max_tokens=30, stop=["a", "e"]),
        SamplingParams(temperature=1.0, seed=13, max_tokens=9, stop_token_ids=STOP_IDS),
    ]


def prompts(n: int, vocab: int) -> list[dict]:
    return [{"prompt_token_ids": [(7 * i + 3 * j) % (vocab - 3) + 3 for j in range(3 + i % 11)]}
            for i in range(n)]


def outputs(llm: LLM, rows: list[dict], sps: list[SamplingParams]) -> list[list[tuple]]:
    got = llm.generate(rows, sps, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason, c.text, c.stop_reason,
              None if c.logprobs is None else [sorted(d) for d in c.logprobs])
             for c in o.outputs] for o in got]


CASES = {
    "plain": dict(max_num_seqs=4),
    "small_chunks": dict(max_num_seqs=4, max_num_batched_tokens=9, block_size=4),
    "preemption": dict(max_num_seqs=6, num_kv_blocks=20, block_size=4),
}


@pytest.mark.parametrize("case", list(CASES))
def test_same_outputs_as_the_synchronous_engine(case: str, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    path = str(tiny_model_dir("qwen3"))
    sync = LLM(path, max_model_len=128, **CASES[case])
    overlapped = LLM(path, max_model_len=128, async_scheduling=True, **CASES[case])
    vocab = sync.engine.vocab_size
    sps = params(vocab)
    rows = prompts(21, vocab)
    per_row = [sps[i % len(sps)] for i in range(len(rows))]
    assert outputs(overlapped, rows, per_row) == outputs(sync, rows, per_row)
    stats = overlapped.engine.stats
    assert stats.overlapped_steps > stats.num_steps // 2
    if case == "preemption":
        assert stats.num_preemptions > 0


def test_steps_that_read_their_own_tokens_do_not_overlap(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    # penalties read the token the step before samples: those steps wait for it
    path = str(tiny_model_dir("qwen3"))
    sp = SamplingParams(temperature=0.8, seed=1, max_tokens=10, repetition_penalty=1.3,
                        ignore_eos=True)
    rows = prompts(5, 100)
    overlapped = LLM(path, max_model_len=128, async_scheduling=True)
    sync = LLM(path, max_model_len=128)
    assert outputs(overlapped, rows, [sp] * 5) == outputs(sync, rows, [sp] * 5)
    assert overlapped.engine.stats.overlapped_steps == 0


def test_abort_and_hold_while_a_step_is_in_flight(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    path = str(tiny_model_dir("qwen3"))
    sp = SamplingParams(temperature=0.8, seed=4, max_tokens=14, ignore_eos=True)
    rows = [r["prompt_token_ids"] for r in prompts(3, 100)]
    want = [o.outputs[0].token_ids for o in LLM(path, max_model_len=128).generate(
        [{"prompt_token_ids": r} for r in rows], sp, use_tqdm=False)]
    e = LLM(path, max_model_len=128, async_scheduling=True).engine
    rids = [e.submit(r, sp) for r in rows]
    for _ in range(5):
        e.step()  # a step is in flight after each call
    assert e.abort(rids[0])
    e.hold(rids[1])
    done = {}
    while e.has_unfinished():
        done.update({o.request_id: o for o in e.step()})
    e.resume(rids[1])
    while e.has_unfinished():
        done.update({o.request_id: o for o in e.step()})
    assert done[rids[0]].outputs[0].finish_reason == "abort"
    assert want[0][:len(done[rids[0]].outputs[0].token_ids)] == done[rids[0]].outputs[0].token_ids
    assert [done[r].outputs[0].token_ids for r in rids[1:]] == want[1:]


def test_overlapped_steps_hand_the_gil_over_promptly(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """The device thread must not wait out CPython's 5 ms switch interval behind the engine
    thread's look-ahead: an overlapped engine lowers it (never raises it)."""
    import sys

    from batchgen_data.engine.overlap import SWITCH_INTERVAL_S

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        LLM(str(tiny_model_dir("qwen3")), max_model_len=64, max_num_seqs=2)
        assert sys.getswitchinterval() == pytest.approx(0.005)  # synchronous: untouched
        LLM(str(tiny_model_dir("qwen3")), max_model_len=64, max_num_seqs=2,
            async_scheduling=True)
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S, rel=0.05)
        sys.setswitchinterval(SWITCH_INTERVAL_S / 2)
        LLM(str(tiny_model_dir("qwen3")), max_model_len=64, max_num_seqs=2,
            async_scheduling=True)
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S / 2, rel=0.05)  # (µs)
    finally:
        sys.setswitchinterval(before)
