"""The default model's first-run conversion says, in one line, what it does, where and how big."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from batchgen_data.models import default_model as dm


def _fake_convert(gguf: Path, out_dir: Path) -> None:
    for name in dm._REQUIRED_FILES:  # the real conversion takes ~30 s; only the files matter here
        (out_dir / name).write_text("{}")


def test_message_names_the_file_the_place_and_the_size(tmp_path: Path) -> None:
    msg = dm.conversion_message(Path("/x/SmolLM2-135M-Instruct.Q4_1.gguf"), tmp_path / "m")
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in msg and str(tmp_path / "m") in msg
    assert "~517 MiB" in msg and "30 s" in msg
    assert "BATCHGEN_CACHE_DIR" in msg and "\n" not in msg


def test_first_run_logs_one_info_line_and_the_cached_run_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(dm, "_convert", _fake_convert)
    with caplog.at_level(logging.INFO, logger=dm.__name__):
        target = dm.default_model_dir(tmp_path)
        lines = [r for r in caplog.records if r.name == dm.__name__]
        assert len(lines) == 1 and lines[0].levelno == logging.INFO
        assert lines[0].getMessage() == dm.conversion_message(dm.find_default_gguf(), target)
        assert capsys.readouterr().err == ""  # logging shows it: no second copy on stderr
        caplog.clear()
        assert dm.default_model_dir(tmp_path) == target
        assert not [r for r in caplog.records if r.name == dm.__name__]


def test_without_logging_configured_it_goes_to_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(dm, "_convert", _fake_convert)
    monkeypatch.setattr(dm.logger, "isEnabledFor", lambda level: False)  # a fresh interpreter
    target = dm.default_model_dir(tmp_path)
    assert capsys.readouterr().err.strip() == dm.conversion_message(dm.find_default_gguf(), target)
