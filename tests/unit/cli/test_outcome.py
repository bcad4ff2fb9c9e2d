"""outcome_from_row: a connector output row (Ray, Spark) → the choices of an OpenAI body."""
from __future__ import annotations

from batchgen_data.cli.inputs import WorkItem
from batchgen_data.cli.outcome import outcome_from_row


def _item() -> WorkItem:
    return WorkItem(key="k", row={"sampling_params": {"logprobs": 2}}, request=None)


def _row(**extra: object) -> dict:
    row = {"generated_text": "ab", "generated_token_ids": [5, 6], "finish_reason": "length",
           "num_prompt_tokens": 3, "error": None, "logprobs": None, "top_logprobs": None,
           "samples": None}
    row.update(extra)
    return row


def test_one_sample_without_logprobs() -> None:
    out = outcome_from_row(_item(), _row(), actor="ray")
    assert [(c.text, list(c.token_ids), c.logprobs) for c in out.choices] == [("ab", [5, 6], None)]
    assert out.prompt_tokens == 3 and out.generated_tokens == 2


def test_logprobs_and_top_alternatives_per_position() -> None:
    # position 1: the sampled token 6 is not among the top two, so the row carries it too
    top = [[{"token_id": 5, "logprob": -0.1}, {"token_id": 9, "logprob": -2.0}],
           [{"token_id": 7, "logprob": -0.5}, {"token_id": 8, "logprob": -0.9},
            {"token_id": 6, "logprob": -3.0}]]
    out = outcome_from_row(_item(), _row(logprobs=[-0.1, -3.0], top_logprobs=top), "ray",
                           num_top=2)
    (c,) = out.choices
    assert c.num_top == 2
    assert c.logprobs == [{5: -0.1, 9: -2.0}, {6: -3.0, 7: -0.5, 8: -0.9}]


def test_n_samples_become_choices_with_the_first_keeping_its_top() -> None:
    samples = [{"index": 0, "text": "ab", "token_ids": [5, 6], "finish_reason": "length",
                "logprobs": [-0.1, -0.2]},
               {"index": 1, "text": "c", "token_ids": [7], "finish_reason": "stop",
                "logprobs": [-0.7]}]
    top = [[{"token_id": 5, "logprob": -0.1}], [{"token_id": 6, "logprob": -0.2}]]
    out = outcome_from_row(_item(), _row(samples=samples, logprobs=[-0.1, -0.2],
                                         top_logprobs=top), "spark", num_top=1)
    assert [c.text for c in out.choices] == ["ab", "c"]
    assert out.choices[1].logprobs == [{7: -0.7}] and out.choices[1].finish_reason == "stop"
    assert out.choices[0].num_top == 1 and out.generated_tokens == 3


def test_error_row() -> None:
    out = outcome_from_row(_item(), _row(error="prompt is null"), "ray")
    assert out.choices == [] and out.error == "prompt is null"
