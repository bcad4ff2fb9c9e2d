"""The `batchgen-data run` command on the default model over the shipped OpenAI Batch example."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchgen_data.cli.main import Job, build_parser

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "batch_api" / "openai_batch.jsonl"
pytestmark = pytest.mark.slow


def _input_ids() -> list[str | None]:
    ids = []
    for text in EXAMPLE.read_text().splitlines():
        try:
            ids.append(json.loads(text).get("custom_id"))
        except json.JSONDecodeError:
            ids.append(None)
    return ids


def _run(*argv: str) -> Job:
    job = Job(build_parser().parse_args(["run", *argv, "--runner", "local",
                                         "--engine-kwargs", '{"max_num_seqs": 8}']))
    assert job.run() == 0
    return job


def _lines(path: Path) -> list[dict]:
    return [json.loads(t) for t in path.read_text().splitlines()]


def _check_body(line: dict) -> None:
    """An OpenAI client's own types accept the body (or, without the package, its shape)."""
    body = line["response"]["body"]
    try:
        from openai.types import Completion
        from openai.types.chat import ChatCompletion
    except ImportError:
        assert body["object"] in ("chat.completion", "text_completion")
        assert set(body["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
        return
    (ChatCompletion if body["object"] == "chat.completion" else Completion).model_validate(body)


def test_command_answers_every_line_once_and_matches_the_python_api(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    report = tmp_path / "report.html"
    _run(str(EXAMPLE), "-o", str(out), "--report", str(report))
    lines = _lines(out)
    by_id = {line["custom_id"]: line for line in lines if line["custom_id"] is not None}
    named = [i for i in _input_ids() if i is not None]
    assert sorted(by_id) == sorted(named) and len(lines) == len(_input_ids())
    for cid, line in by_id.items():
        if cid.startswith("bad-"):
            assert line["response"] is None and line["error"]["message"].startswith("line ")
        elif cid.startswith("chat-json"):
            _check_structured(line)
        else:
            assert line["error"] is None, line
            _check_body(line)
    assert len(by_id["chat-sampled-n2"]["response"]["body"]["choices"]) == 2
    lp = by_id["chat-logprobs"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert all(len(t["top_logprobs"]) == 2 for t in lp)
    assert "stop" == by_id["chat-stop"]["response"]["body"]["choices"][0]["finish_reason"]

    from batchgen_data import LLM, SamplingParams

    llm = LLM(max_num_seqs=8)
    chat = llm.chat([{"role": "system", "content": "You answer in one short sentence."},
                     {"role": "user", "content": "Name a colour of the rainbow."}],
                    SamplingParams(max_tokens=20, temperature=0.7, top_p=0.9, seed=7),
                    use_tqdm=False)
    text = llm.generate("The three primary colours are", SamplingParams(max_tokens=16,
                        temperature=0), use_tqdm=False)
    body = by_id["chat-system"]["response"]["body"]
    assert body["choices"][0]["message"]["content"] == chat[0].outputs[0].text
    assert body["usage"]["prompt_tokens"] == len(chat[0].prompt_token_ids)
    body = by_id["completion-plain"]["response"]["body"]
    assert body["choices"][0]["text"] == text[0].outputs[0].text
    html = report.read_text()
    assert html.count("<svg") >= 4 and "src=\"http" not in html


def _check_structured(line: dict) -> None:
    """A response_format line is answered, and its content parses (and fits its schema)."""
    assert line["error"] is None, line
    _check_body(line)
    choice = line["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "stop", choice  # truncated JSON would not parse
    content = json.loads(choice["message"]["content"])
    assert isinstance(content, dict)
    if line["custom_id"] == "chat-json-schema":
        schema = _request(line["custom_id"])["body"]["response_format"]["json_schema"]["schema"]
        jsonschema = pytest.importorskip("jsonschema")
        jsonschema.validate(content, schema)
        assert isinstance(content["name"], str) and isinstance(content["born"], int)


def _request(custom_id: str) -> dict:
    for text in EXAMPLE.read_text().splitlines():
        try:
            line = json.loads(text)
        except json.JSONDecodeError:
            continue
        if line.get("custom_id") == custom_id:
            return line
    raise KeyError(custom_id)


def test_resume_after_a_kill_redoes_nothing(tmp_path: Path) -> None:
    rows = tmp_path / "in.jsonl"
    body = {"max_tokens": 24, "temperature": 0}
    rows.write_text("".join(json.dumps({
        "custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {**body, "messages": [{"role": "user", "content": f"Tell me fact {i}."}]}}) + "\n"
        for i in range(12)))
    out = tmp_path / "out.jsonl"
    # one sequence at a time, so lines arrive one by one and the kill lands mid-run
    cmd = [sys.executable, "-m", "batchgen_data.cli", "run", str(rows), "-o", str(out),
           "--runner", "local", "--engine-kwargs", '{"max_num_seqs": 1}']
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and out.read_text().count("\n") >= 3:
            break
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with out.open("a") as f:
        f.write('{"id": "batch_req_torn", "custom_id": "r1')  # as if killed mid-line
    before = {line["custom_id"] for line in _lines_skipping_torn(out)}
    assert 3 <= len(before) < 12
    job = _run(str(rows), "-o", str(out), "--resume")
    assert job.runner.submitted == 12 - len(before)
    ids = [line["custom_id"] for line in _lines(out)]
    assert sorted(ids) == sorted(f"r{i}" for i in range(12))
    again = _run(str(rows), "-o", str(out), "--resume")
    assert again.runner is None  # nothing left: not even an engine is built
    assert len(_lines(out)) == 12


def _lines_skipping_torn(path: Path) -> list[dict]:
    return [json.loads(t) for t in path.read_text().splitlines() if t.endswith("}")]
