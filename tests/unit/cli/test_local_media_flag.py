"""`batchgen-data run --allowed-local-media-path DIR` is vLLM's engine argument
allowed_local_media_path (absolute, so a Ray actor with another working directory reads the
same directory), which the image pipeline reads and the engine's config drops."""
from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import pytest

from batchgen_data.config import make_engine_config
from batchgen_data.inputs.image_options import ImageOptions

cli_main = importlib.import_module("batchgen_data.cli.main")  # (the package exports its main())
LINE = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}


def _job_kwargs(tmp_path: Path, *flags: str) -> dict:
    (tmp_path / "in.jsonl").write_text(json.dumps(LINE) + "\n")
    args = cli_main.build_parser().parse_args(["run", "in.jsonl", "-o", "out.jsonl",
                                               "--runner", "local", *flags])
    job = cli_main.Job(args)
    job.lock.release()
    return dict(args.engine_kwargs)


def test_flag_becomes_the_engine_argument(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "media").mkdir()
    kwargs = _job_kwargs(tmp_path, "--allowed-local-media-path", "media")
    assert kwargs == {"allowed_local_media_path": str(tmp_path / "media")}
    assert ImageOptions.of(kwargs).allowed_local_media_path == os.path.realpath(
        tmp_path / "media")
    make_engine_config(None, **kwargs)  # the engine takes the name and leaves it alone
    assert "allowed_local_media_path" not in _job_kwargs(tmp_path)
