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
                  "body": {"messages": [{"role": "user", "content": "x"}], "n": 2,
                           "max_tokens": 6, "seed": 3}})
    lines.append({"custom_id": "lp", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
                           "temperature": 0, "logprobs": True, "top_logprobs": 2}})
    lines.append({"custom_id": "n2lp", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"messages": [{"role": "user", "content": "x"}], "n": 2,
                           "logprobs": True, "top_logprobs": 1}})
    # values no runner can take: each runner answers them with the same named error
    poison = {"bad-n": ({"n": "2"}, "SamplingParams.n"),
              "bad-seed": ({"seed": 2**64, "temperature": 0.8}, "SamplingParams.seed")}
    for key, (body, _) in poison.items():
        lines.append({"custom_id": key, "method": "POST", "url": "/v1/chat/completions",
                      "body": {"messages": [{"role": "user", "content": "x"}], **body}})
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
    assert sorted(ray_answers) == ["bad-n", "bad-seed", "c0", "c1", "c2", "lp", "n2", "n2lp",
                                   "t0"]
    for key in ("c0", "c1", "c2", "t0", "n2", "lp"):
        assert ray_answers[key] == local_answers[key], key
    assert len(ray_answers["n2"]) == 2

    def line(path: Path, key: str) -> dict:
        return [json.loads(t) for t in path.read_text().splitlines()
                if json.loads(t)["custom_id"] == key][0]

    # logprobs through the connector's columns: the same tokens and top alternatives as local
    ray_lp, local_lp = (line(p, "lp")["response"]["body"]["choices"][0]["logprobs"]["content"]
                        for p in (ray_out, local_out))
    assert [t["token"] for t in ray_lp] == [t["token"] for t in local_lp]
    assert [[a["token"] for a in t["top_logprobs"]] for t in ray_lp] == \
        [[a["token"] for a in t["top_logprobs"]] for t in local_lp]
    assert all(len(t["top_logprobs"]) == 2 for t in ray_lp)
    for r, lo in zip(ray_lp, local_lp):
        assert abs(r["logprob"] - lo["logprob"]) < 1e-4
    for key, (_, field) in poison.items():
        for path in (ray_out, local_out):
            assert field in line(path, key)["error"]["message"], (path, key)
    # top alternatives of every one of n samples: only the local runner has them
    assert "--runner local" in line(ray_out, "n2lp")["error"]["message"]
    html = report.read_text()
    assert html.count("<h3>") >= 1 and "idle" in html  # a timeline per engine that reported
