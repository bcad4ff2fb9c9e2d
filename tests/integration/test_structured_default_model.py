"""Structured output on the embedded default model (SmolLM2-135M-Instruct): with a real
model every kind of constraint ends on its own, and every output parses and validates, greedy
and sampled, all in one batch."""
from __future__ import annotations

import json
import re

import pytest

from batchgen_data import LLM, SamplingParams

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 30},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "city": {"type": "string", "maxLength": 30}}}
EXTRACT = "Extract the person as JSON with name, age and city: Maria Lopez is 34 and lives in Madrid."
CASES = [  # (constraint, question, check of the text)
    ({"json": PERSON}, EXTRACT, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"json_object": True}, EXTRACT, lambda t: isinstance(json.loads(t), dict)),
    ({"regex": r"(yes|no), because [a-z ]{1,30}\."}, "Is the sky blue? Answer yes or no.",
     lambda t: re.fullmatch(r"(yes|no), because [a-z ]{1,30}\.", t) is not None),
    ({"choice": ["positive", "negative", "neutral"]},
     "Sentiment of: 'the battery died after two days'?",
     lambda t: t in ("positive", "negative", "neutral")),
    ({"grammar": 'root ::= answer ". Confidence: " [0-9] "/10"\nanswer ::= "yes" | "no"'},
     "Is Paris the capital of France?",
     lambda t: re.fullmatch(r"(yes|no)\. Confidence: \d/10", t) is not None),
]


@pytest.mark.slow
def test_default_model_outputs_always_validate() -> None:
    llm = LLM()
    convs, params, checks = [], [], []
    for spec, question, check in CASES:
        for temperature, seed in ((0.0, 0), (0.8, 1)):
            convs.append([{"role": "user", "content": question}])
            params.append(SamplingParams(temperature=temperature, seed=seed, max_tokens=64,
                                         structured_outputs=spec))
            checks.append(check)
    outs = llm.chat(convs, params, use_tqdm=False)
    for out, check, sp in zip(outs, checks, params):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (sp.structured_outputs, c.text)
        assert check(c.text), (sp.structured_outputs, c.text)
