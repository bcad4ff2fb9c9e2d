"""`batchgen-data run --runner ray`: the same lines as the local runner, and a report whose
per-actor timelines come from the actors (Ray metrics path)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchgen_data.cli.main import Job, build_parser

pytestmark = pytest.mark.slow


def _job(*argv: str) -> Job:
    job = Job(build_parser().parse_args(["run", *argv, "--engine-kwargs",
                                         '{"max_num_seqs": 8, "enable_chunked_prefill": true}']))
    assert job.run() == 0
    return job


def test_ray_runner_matches_local_runner(tmp_path: Path, ray_local: None) -> None:
    src = tmp_path / "in.jsonl"
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": q}], "max_tokens": 12,
                       "temperature": 0.8, "seed": i}}
             for i, q in enumerate(["What is the capital of France?", "Name a fruit.",
                                    "Say something kind."])]
    lines.append({"custom_id": "t0", "method": "POST", "url": "/v1/completions",
                  "body": {"prompt": "The sky is", "max_tokens": 8, "temperature": 0}})
    lines.append({"custom_id": "n2", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"messages": [{"role": "user", "content": "x"}], "n": 2}})
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    ray_out, local_out, report = tmp_path / "ray.jsonl", tmp_path / "local.jsonl", \
        tmp_path / "r.html"
    _job(str(src), "-o", str(ray_out), "--runner", "ray", "--actors", "2", "--report",
         str(report))
    _job(str(src), "-o", str(local_out), "--runner", "local")

    def answers(path: Path) -> dict:
        out = {}
        for line in map(json.loads, path.read_text().splitlines()):
            body = (line["response"] or {}).get("body") or {}
            out[line["custom_id"]] = [c.get("message", {}).get("content", c.get("text"))
                                      for c in body.get("choices", [])]
        return out

    ray_answers, local_answers = answers(ray_out), answers(local_out)
    assert sorted(ray_answers) == ["c0", "c1", "c2", "n2", "t0"]
    for key in ("c0", "c1", "c2", "t0"):
        assert ray_answers[key] == local_answers[key], key
    n2 = [json.loads(t) for t in ray_out.read_text().splitlines() if '"n2"' in t][0]
    assert "--runner local" in n2["error"]["message"]
    html = report.read_text()
    assert html.count("<h3>") >= 1 and "idle" in html  # a timeline per engine that reported
