"""Structured output on a tiny random model: every generated token is one the grammar allows
(checked by an independent xgrammar matcher), finished outputs parse and validate, greedy and
sampled; constrained rows leave the unconstrained rows of their batch unchanged; a constrained
sequence continues identically after recompute, hold/resume and export/import."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any, Callable

import pytest

from batchgen_data import LLM, SamplingParams

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "n"]}
REGEX = r"[a-c]{2,5}-\d\d"
CHOICES = ["yes", "no", "maybe so"]
GRAMMAR = 'root ::= "(" [0-9]+ ")"'


def valid(kind: str, text: str) -> bool:
    if kind in ("json", "json_object"):
        value = json.loads(text)
        if kind == "json":
            jsonschema.validate(value, SCHEMA)
        return isinstance(value, dict)
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"\(\d+\)", text) is not None


SPECS: dict[str, dict[str, Any]] = {
    "json": {"json": SCHEMA, "disable_any_whitespace": True},
    "json_object": {"json_object": True},
    "regex": {"regex": REGEX},
    "choice": {"choice": CHOICES},
    "grammar": {"grammar": GRAMMAR},
}
PROMPTS = ["Extract the invoice number as JSON.", "The quick brown fox", "What is the capital"]


@pytest.fixture(scope="module")
def path(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def llm(path: Path) -> LLM:
    return LLM(str(path), block_size=4)


def oracle(llm: LLM, spec: dict[str, Any]) -> Any:
    """A matcher built here, from the tokenizer and xgrammar directly (not the engine's)."""
    e = llm.engine
    info = xgr.TokenizerInfo.from_huggingface(e.tokenizer, vocab_size=e.vocab_size,
                                              stop_token_ids=sorted(e.stopper.eos_token_ids))
    c = xgr.GrammarCompiler(info)
    if "json" in spec:
        g = c.compile_json_schema(json.dumps(spec["json"]), any_whitespace=False)
    elif "json_object" in spec:
        g = c.compile_json_schema('{"type": "object"}', strict_mode=False)
    elif "regex" in spec:
        g = c.compile_regex(spec["regex"])
    elif "choice" in spec:
        g = c.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in spec["choice"]))
    else:
        g = c.compile_grammar(spec["grammar"])
    return xgr.GrammarMatcher(g)


@pytest.mark.parametrize("kind", list(SPECS))
def test_every_token_is_allowed_and_finished_outputs_validate(llm: LLM, kind: str) -> None:
    spec = SPECS[kind]
    params = [SamplingParams(temperature=t, seed=s, max_tokens=48, structured_outputs=spec)
              for t in (0.0, 1.0) for s in (0, 1, 2)]
    outs = llm.generate([PROMPTS[i % 3] for i in range(len(params))], params, use_tqdm=False)
    finished = 0
    for out in outs:
        c = out.outputs[0]
        m = oracle(llm, spec)
        for tok in c.token_ids:  # a masked token would be rejected here
            assert m.accept_token(tok), (kind, c.text, tok)
        if c.finish_reason == "stop":
            finished += 1
            assert m.is_terminated()  # it ended on EOS, which the grammar allowed only there
            assert valid(kind, c.text), (kind, c.text)
        else:
            assert c.finish_reason == "length"  # truncated: a valid prefix, may not parse
    # json_object strings may run on in a random model; the others must end within 48 tokens
    assert finished >= (1 if kind == "json_object" else len(outs))


def test_unconstrained_rows_are_untouched_by_constrained_neighbours(llm: LLM) -> None:
    plain = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True)]
    alone = llm.generate(PROMPTS[:2], plain, use_tqdm=False)
    constrained = [SamplingParams(temperature=t, seed=3, max_tokens=48, structured_outputs=s)
                   for t, s in ((0.0, SPECS["regex"]), (1.0, SPECS["json"]))]
    mixed = llm.generate(PROMPTS[:2] + PROMPTS[1:3], plain + constrained, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]
    for kind, out in zip(("regex", "json"), mixed[2:]):
        assert out.outputs[0].finish_reason == "stop" and valid(kind, out.outputs[0].text)


def drain(engine: Any) -> dict[str, Any]:
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] = o
    return out


@pytest.mark.parametrize("move", ["recompute", "export"])
def test_moved_sequences_replay_their_matcher(path: Path, llm: LLM, move: str) -> None:
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=40,
                            structured_outputs=SPECS["json"], n=2)
    ref = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    src = LLM(str(path), block_size=4).engine
    ids = src.tokenizer.encode(PROMPTS[0])
    rid = src.submit(ids, params)
    for _ in range(6):
        src.step()
    if move == "recompute":
        src.hold(rid, keep_kv=False)
        src.resume(rid)
        got = drain(src)[rid]
    else:
        dst = LLM(str(path), block_size=8).engine
        dst.import_(copy.deepcopy(src.export(rid)))
        got = drain(dst)[rid]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in ref.outputs]
    assert all(valid("json", c.text) for c in got.outputs if c.finish_reason == "stop")


def test_bad_constraints_are_the_requests_error(llm: LLM) -> None:
    for spec, match in (({"regex": "("}, "regex does not compile"),
                        ({"grammar": "root ::= ("}, "grammar does not compile"),
                        ({"json": {"type": "nonsense"}}, "json does not compile")):
        with pytest.raises(ValueError, match=match):
            llm.generate(["hi"], SamplingParams(structured_outputs=spec), use_tqdm=False)
