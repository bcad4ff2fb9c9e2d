"""Reasoning through the engine: outputs split by the parser, and the thinking budget as a
coroutine event, checked token by token.

A tiny random model cannot think, so most cases drive the real engine with a runner whose
logits allow one token per sampled row (`ScriptedRunner`, a fake at the runner seam): a
"thinker" that opens its reasoning if the prompt did not, thinks a set number of filler
tokens, closes it, answers and ends. The budget's prefill is checked against HF instead: the
tiny model's own greedy tokens, where after the budget they must be HF's greedy continuation
of prompt + reasoning + the appended end (a wrong KV for the appended tokens changes them).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from batchgen_data import LLM, SamplingParams
from batchgen_data.config import make_engine_config
from batchgen_data.engine.engine import Engine
from batchgen_data.engine.setup import build_parts
from batchgen_data.reasoning.think import DEFAULT_END_STR
from tests.conftest import CHATML, build_tiny_model, build_tokenizer

# R1's template opens the reasoning; Qwen3's writes an empty one when thinking is off
R1_TEMPLATE = CHATML.replace("assistant\n{% endif %}", "assistant\n<think>\n{% endif %}")
QWEN3_TEMPLATE = CHATML.replace(
    "assistant\n{% endif %}",
    "assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}")
EOS = 2  # <|im_end|>, the tiny models' eos_token_id


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-thinker")
    tok = build_tokenizer(path)
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = R1_TEMPLATE  # what the command renders with
    tok.save_pretrained(path)
    build_tiny_model("llama", path, vocab_size=len(tok))
    return path


class Thinker:
    """A scripted reasoning model: per request, `lengths[prompt]` filler tokens of thought
    (opening `<think>` itself when the prompt did not), `</think>`, the answer, EOS. A prompt
    that closed the reasoning (thinking off) gets the answer at once."""

    def __init__(self, tok: Any, lengths: dict[tuple[int, ...], int]) -> None:
        vocab = tok.get_vocab()
        self.start, self.end = vocab["<think>"], vocab["</think>"]
        self.filler = tok.encode("dog")[0]
        self.answer = tok.encode("Paris")
        self.lengths = lengths
        # per sample: [thought tokens, answer tokens] it wrote
        self.said: dict[tuple[str, int], list[int]] = {}

    def __call__(self, seq: Any) -> int:
        said = self.said.setdefault((seq.request_id, seq.index), [0, 0])
        out = seq.token_ids[len(seq.prompt_token_ids):]
        tags = [t for t in seq.prompt_token_ids if t in (self.start, self.end)]
        if self.end in out or (tags and tags[-1] == self.end):
            said[1] += 1
            return self.answer[said[1] - 1] if said[1] <= len(self.answer) else EOS
        if not tags and self.start not in out:
            return self.start
        if said[0] < self.lengths[tuple(seq.prompt_token_ids)]:
            said[0] += 1
            return self.filler
        return self.end


class ScriptedRunner:
    """The model runner, but each sampled row's logits allow only its script's next token."""

    def __init__(self, runner: Any, script: Thinker) -> None:
        self.runner, self.script = runner, script

    def run(self, inp: Any) -> torch.Tensor:
        logits = self.runner.run(inp)
        forced = torch.full_like(logits, -1e9)
        for i, seq in enumerate(inp.sample_seqs):
            forced[i, self.script(seq)] = 0.0
        return forced

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)


def scripted_llm(model_dir: Path, lengths: dict[tuple[int, ...], int], **kwargs: Any
                 ) -> tuple[LLM, Thinker]:
    config = make_engine_config(str(model_dir), device="cpu", max_model_len=512,
                                num_kv_blocks=128, **kwargs)
    parts = build_parts(config)
    thinker = Thinker(parts.tokenizer, lengths)
    parts.runner = ScriptedRunner(parts.runner, thinker)
    return LLM._over(Engine(config, parts)), thinker


def chat_ids(llm: LLM, text: str, template: str, **kwargs: Any) -> list[int]:
    return llm.render_chat([{"role": "user", "content": text}], chat_template=template,
                           chat_template_kwargs=kwargs or None)[0]


GREEDY = dict(temperature=0.0, max_tokens=120)


def test_reasoning_and_answer_come_apart(model_dir: Path) -> None:
    llm, t = scripted_llm(model_dir, {}, reasoning_parser="deepseek_r1")
    ids = chat_ids(llm, "Write a short poem", R1_TEMPLATE)
    t.lengths[tuple(ids)] = 6
    short = chat_ids(llm, "Summarise the following paragraph", R1_TEMPLATE)
    t.lengths[tuple(short)] = 50
    full, cut = llm.generate([{"prompt_token_ids": ids}, {"prompt_token_ids": short}],
                             [SamplingParams(**GREEDY), SamplingParams(temperature=0.0,
                                                                       max_tokens=5)],
                             use_tqdm=False)
    c = full.outputs[0]
    assert c.token_ids == [t.filler] * 6 + [t.end] + t.answer + [EOS]
    assert (c.text, c.reasoning_text, c.num_reasoning_tokens, c.finish_reason) == (
        llm.tokenizer.decode(t.answer), llm.tokenizer.decode([t.filler] * 6), 6, "stop")
    # cut by max_tokens while thinking: no answer, the reasoning kept, finish "length"
    c = cut.outputs[0]
    assert (c.text, c.reasoning_text, c.num_reasoning_tokens, c.finish_reason) == (
        "", llm.tokenizer.decode([t.filler] * 5), 5, "length")


def test_qwen3_thinking_switched_per_row(model_dir: Path) -> None:
    llm, t = scripted_llm(model_dir, {}, reasoning_parser="qwen3")
    on = chat_ids(llm, "Write a short poem", QWEN3_TEMPLATE)
    off = chat_ids(llm, "Write a short poem", QWEN3_TEMPLATE, enable_thinking=False)
    t.lengths[tuple(on)] = 4
    a, b = llm.generate([{"prompt_token_ids": on}, {"prompt_token_ids": off}],
                        SamplingParams(**GREEDY), use_tqdm=False)
    answer = llm.tokenizer.decode(t.answer)
    assert a.outputs[0].token_ids[0] == t.start  # the model opened its reasoning itself
    assert (a.outputs[0].text, a.outputs[0].reasoning_text, a.outputs[0].num_reasoning_tokens) \
        == (answer, llm.tokenizer.decode([t.filler] * 4), 4)
    assert (b.outputs[0].text, b.outputs[0].reasoning_text, b.outputs[0].num_reasoning_tokens) \
        == (answer, None, 0)


def test_budget_appends_the_end_and_the_row_answers(model_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """At the budget the end of thinking is appended and prefilled in the row's next step,
    the row keeping its blocks; a row without a budget in the same batch thinks on."""
    llm, t = scripted_llm(model_dir, {}, reasoning_parser="deepseek_r1")
    engine = llm.engine
    ids = chat_ids(llm, "Write a short poem", R1_TEMPLATE)
    other = chat_ids(llm, "Classify the sentiment of this review", R1_TEMPLATE)
    t.lengths[tuple(ids)], t.lengths[tuple(other)] = 20, 7
    steps: list[list[tuple[str, int, int]]] = []
    schedule = engine.scheduler.schedule

    def noted() -> Any:
        out = schedule()
        steps.append([(s.request_id, n, s.block_ids[0]) for s, n in
                      zip(out.seqs, out.num_new_tokens)])
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", noted)
    end_ids = llm.tokenizer.encode(DEFAULT_END_STR, add_special_tokens=False)
    budgeted, free = llm.generate(
        [{"prompt_token_ids": ids}, {"prompt_token_ids": other}],
        [SamplingParams(thinking_token_budget=4, **GREEDY), SamplingParams(**GREEDY)],
        use_tqdm=False)
    c = budgeted.outputs[0]
    assert c.token_ids == [t.filler] * 4 + end_ids + t.answer + [EOS]
    close = end_ids.index(t.end)
    assert c.reasoning_text == llm.tokenizer.decode([t.filler] * 4 + end_ids[:close])
    assert c.text == llm.tokenizer.decode(end_ids[close + 1:] + t.answer)
    assert c.num_reasoning_tokens == 4 + close and c.finish_reason == "stop"
    assert free.outputs[0].token_ids == [t.filler] * 7 + [t.end] + t.answer + [EOS]
    rid = budgeted.request_id
    mine = [(n, block) for step in steps for r, n, block in step if r == rid]
    # the prompt (sampling thought 1), 3 one-token decodes (the 3rd samples thought 4, the
    # budget), then that token and the appended end in one step: a prefill, same first block
    assert [n for n, _ in mine[1:5]] == [1, 1, 1, 1 + len(end_ids)]
    assert len({block for _, block in mine}) == 1 and engine.stats.num_preemptions == 0


def test_budget_zero_ends_the_thinking_before_the_first_token(model_dir: Path) -> None:
    llm, t = scripted_llm(model_dir, {}, reasoning_parser="deepseek_r1",
                          reasoning_end_str="Enough.</think>")
    ids = chat_ids(llm, "Write a short poem", R1_TEMPLATE)
    t.lengths[tuple(ids)] = 9
    out = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(thinking_token_budget=0, **GREEDY), use_tqdm=False)[0]
    end_ids = llm.tokenizer.encode("Enough.</think>", add_special_tokens=False)
    assert out.outputs[0].token_ids == end_ids + t.answer + [EOS]
    assert out.outputs[0].reasoning_text == "Enough."


def test_budget_survives_export_and_import(model_dir: Path) -> None:
    """An exported row's budget state comes back from its tokens: moved mid-thought, it is
    cut at the same token as a row that never moved."""
    llm, t = scripted_llm(model_dir, {}, reasoning_parser="deepseek_r1")
    other, _ = scripted_llm(model_dir, t.lengths, reasoning_parser="deepseek_r1")
    other.engine.runner.script = t  # one script: it answers by request, wherever it runs
    ids = chat_ids(llm, "Write a short poem", R1_TEMPLATE)
    t.lengths[tuple(ids)] = 20
    params = SamplingParams(thinking_token_budget=6, **GREEDY)
    rid = llm.engine.submit(ids, params, request_id="moved")
    for _ in range(4):  # prompt + 3 thought tokens
        llm.engine.step()
    other.engine.import_(llm.engine.export(rid))
    done = []
    while other.engine.has_unfinished():
        done += other.engine.step()
    end_ids = llm.tokenizer.encode(DEFAULT_END_STR, add_special_tokens=False)
    assert done[0].outputs[0].token_ids == [t.filler] * 6 + end_ids + t.answer + [EOS]


def test_budget_prefill_continues_as_hf(model_dir: Path, hf_model: Any) -> None:
    """No script: the tiny model's greedy tokens. After the budget the row must continue as
    HF's greedy decoding of prompt + its reasoning + the appended end does."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    llm = LLM(str(model_dir), device="cpu", max_model_len=512, num_kv_blocks=128,
              reasoning_parser="deepseek_r1", reasoning_end_str="Enough now.</think>\n")
    ids = chat_ids(llm, "Write a short poem", R1_TEMPLATE)
    end_ids = tok.encode("Enough now.</think>\n", add_special_tokens=False)
    budget, after = 3, 6
    params = SamplingParams(temperature=0.0, ignore_eos=True, thinking_token_budget=budget,
                            max_tokens=budget + len(end_ids) + after)
    got = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]

    model = hf_model(model_dir)

    def greedy(prefix: list[int], n: int) -> list[int]:
        seq = list(prefix)
        with torch.no_grad():
            for _ in range(n):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        return seq[len(prefix):]

    thought = greedy(ids, budget)
    assert tok.convert_tokens_to_ids("</think>") not in thought  # else no budget to reach
    expected = thought + end_ids + greedy(ids + thought + end_ids, after)
    assert got.token_ids == expected


def test_budget_refusals(model_dir: Path) -> None:
    llm, _ = scripted_llm(model_dir, {})
    with pytest.raises(ValueError, match="thinking_token_budget needs the engine's "
                                         "reasoning_parser"):
        llm.generate(["Hi"], SamplingParams(thinking_token_budget=4), use_tqdm=False)
    llm, _ = scripted_llm(model_dir, {}, reasoning_parser="qwen3")
    with pytest.raises(ValueError, match="with logprobs is not supported"):
        llm.generate(["Hi"], SamplingParams(thinking_token_budget=4, logprobs=1),
                     use_tqdm=False)
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None  # vLLM's
    for bad in (-2, True, 1.5):
        with pytest.raises(ValueError, match="thinking_token_budget"):
            SamplingParams(thinking_token_budget=bad)


def test_the_command_writes_reasoning_apart(model_dir: Path, tmp_path: Path) -> None:
    """`batchgen-data run --reasoning-parser`: a line cut while thinking has an empty answer
    and all its text as reasoning; `reasoning_effort: "none"` ends the thinking at once and the
    answer is the model's greedy continuation after the appended end (the oracle: the engine
    without a parser, given prompt + end as its prompt)."""
    import json

    from batchgen_data.cli.main import Job, build_parser

    def line(cid: str, **body: Any) -> str:
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                           "body": {"messages": [{"role": "user", "content": "Hi"}],
                                    "temperature": 0.0, **body}})

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(line("think", max_tokens=12) + "\n"
                   + line("none", max_tokens=200, reasoning_effort="none") + "\n")
    kwargs = '{"device": "cpu", "max_model_len": 512, "num_kv_blocks": 128}'
    job = Job(build_parser().parse_args(["run", str(src), "-o", str(dst), "--model",
                                         str(model_dir), "--runner", "local",
                                         "--engine-kwargs", kwargs,
                                         "--reasoning-parser", "deepseek_r1"]))
    assert job.run() == 0
    lines = [json.loads(t) for t in dst.read_text().splitlines()]
    assert [d["error"] for d in lines] == [None, None]
    bodies = {d["custom_id"]: d["response"]["body"] for d in lines}

    plain = LLM(str(model_dir), device="cpu", max_model_len=512, num_kv_blocks=128)
    ids = plain.render_chat([{"role": "user", "content": "Hi"}])[0]
    cut = plain.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0,
                                                                     max_tokens=12),
                         use_tqdm=False)[0].outputs[0]
    think = bodies["think"]
    assert cut.finish_reason == "length" and plain.engine.reasoning is None
    assert think["choices"][0]["message"]["content"] == ""
    assert think["choices"][0]["message"]["reasoning_content"] == cut.text
    assert think["usage"]["completion_tokens_details"]["reasoning_tokens"] == 12

    end_ids = plain.tokenizer.encode(DEFAULT_END_STR, add_special_tokens=False)
    close = end_ids.index(plain.tokenizer.convert_tokens_to_ids("</think>"))
    after = plain.generate([{"prompt_token_ids": ids + end_ids}],
                           SamplingParams(temperature=0.0, max_tokens=200 - len(end_ids)),
                           use_tqdm=False)[0].outputs[0]
    none = bodies["none"]["choices"][0]["message"]
    assert none["reasoning_content"] == plain.tokenizer.decode(end_ids[:close])
    assert none["content"] == plain.tokenizer.decode(
        end_ids[close + 1:] + [t for t in after.token_ids if t != EOS])


TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\n<tools>{{ tools | tojson }}</tools>"
                  "<|im_end|>\n{% endif %}" + QWEN3_TEMPLATE)
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}]


def test_tool_calls_come_out_in_openais_shape(model_dir: Path) -> None:
    """Tools rendered as HF's `apply_chat_template(tools=)` renders them; a thinking row and a
    non-thinking row both answer with a hermes call: reasoning apart, the call parsed, finish
    "tool_calls"; a call with broken JSON is the row's `tool_call_error`, its text kept."""
    from transformers import AutoTokenizer

    llm, t = scripted_llm(model_dir, {}, reasoning_parser="qwen3", tool_call_parser="hermes")
    hi = [{"role": "user", "content": "Write a short poem"}]
    ids, text = llm.render_chat(hi, chat_template=TOOLS_TEMPLATE,
                                chat_template_kwargs={"tools": WEATHER})
    hf = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        hi, tools=WEATHER, chat_template=TOOLS_TEMPLATE, tokenize=False,
        add_generation_prompt=True)
    assert text == hf and '"name": "get_weather"' in text
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    t.answer = llm.tokenizer.encode(call)
    t.lengths[tuple(ids)] = 3
    off = llm.chat(hi, SamplingParams(**GREEDY), chat_template=TOOLS_TEMPLATE, tools=WEATHER,
                   chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)[0]
    on = llm.chat(hi, SamplingParams(**GREEDY), chat_template=TOOLS_TEMPLATE, tools=WEATHER,
                  use_tqdm=False)[0]
    for out, reasoning in ((off, None), (on, llm.tokenizer.decode([t.filler] * 3))):
        c = out.outputs[0]
        assert (c.finish_reason, c.text, c.reasoning_text, c.tool_call_error) == (
            "tool_calls", "", reasoning, None)
        assert [x["function"] for x in c.tool_calls] == [
            {"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    broken = call.replace('"Paris"', "Paris")
    t.answer = llm.tokenizer.encode(broken)
    c = llm.chat(hi, SamplingParams(**GREEDY), chat_template=TOOLS_TEMPLATE, tools=WEATHER,
                 chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)[0].outputs[0]
    assert (c.finish_reason, c.text, c.tool_calls) == ("stop", broken, None)
    assert c.tool_call_error.startswith("tool call 0: not valid JSON")


def test_job_cap_cuts_the_tail_at_the_jobs_quantile(model_dir: Path) -> None:
    """`thinking_cap_quantile=0.9`: once 16 of 17 rows ended their reasoning themselves (3..18
    thought tokens), the one still thinking (it would think 300) counts as at least 18, so the
    estimated share above 18 is 1/17 <= 0.1: it is cut at 18 within a step, its end appended
    as a budget's; the short rows keep their own lengths. (At 0.95 it would not be cut: one
    row in 17 is more than 5%.)"""
    llm, t = scripted_llm(model_dir, {}, reasoning_parser="deepseek_r1",
                          thinking_cap_quantile=0.9)
    prompts = []
    for i, n in enumerate([*range(3, 19), 300]):
        ids = chat_ids(llm, f"Write a short poem {i}", R1_TEMPLATE)
        t.lengths[tuple(ids)] = n
        prompts.append({"prompt_token_ids": ids})
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=400),
                        use_tqdm=False)
    for out, n in zip(outs[:-1], range(3, 19)):
        assert out.outputs[0].token_ids == [t.filler] * n + [t.end] + t.answer + [EOS]
    assert llm.engine.thinking_cap.value == 18
    end_ids = llm.tokenizer.encode(DEFAULT_END_STR, add_special_tokens=False)
    long = outs[-1].outputs[0].token_ids
    k = long.index(end_ids[0])
    assert k in (19, 20) and long == [t.filler] * k + end_ids + t.answer + [EOS]
