"""Models named by URL (batchgen_data/models/sources.py): `file://` and fsspec's in-memory
filesystem load like the local directory; concurrent processes of one node copy once; a
truncated or half-copied cache is found and copied again."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from batchgen_data.models import loader, sources

fsspec = pytest.importorskip("fsspec")

PROMPTS = [{"prompt_token_ids": [1, 5, 9, 3]}, {"prompt_token_ids": [2, 7]}]


def greedy_tokens(model: str) -> list[list[int]]:
    from batchgen_data import LLM, SamplingParams

    llm = LLM(model=model, seed=0, max_model_len=64, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "model-cache"
    monkeypatch.setenv("BATCHGEN_MODEL_CACHE_DIR", str(path))
    return path


@pytest.fixture
def memory_model(tiny_model_dir: Callable[..., Path]) -> Iterator[str]:
    fs = fsspec.filesystem("memory")
    for f in tiny_model_dir("llama").iterdir():
        fs.pipe(f"/models/tiny-llama/{f.name}", f.read_bytes())
    yield "memory://models/tiny-llama"
    fs.rm("/models/tiny-llama", recursive=True)


def files(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in path.iterdir() if p.name != sources.MANIFEST}


def test_is_url() -> None:
    assert sources.is_url("file:///a/b") and sources.is_url("simplecache::s3://b/x")
    assert not sources.is_url("/a/b") and not sources.is_url("org/model")
    assert not sources.is_url(None)


def test_a_file_url_loads_like_the_directory(tiny_model_dir: Callable[..., Path],
                                             cache: Path) -> None:
    local = tiny_model_dir("llama")
    url = local.as_uri()
    path = loader.resolve_model_path(url)
    assert path.parent == cache and files(path) == files(local)
    assert greedy_tokens(url) == greedy_tokens(str(local))
    assert sources.fetch(url) == sources.Fetched(path, copied=False)  # cached: no second copy


def test_an_fsspec_memory_url_loads_like_the_directory(tiny_model_dir: Callable[..., Path],
                                                       memory_model: str, cache: Path) -> None:
    path = loader.resolve_model_path(memory_model)
    assert path.is_relative_to(cache) and files(path) == files(tiny_model_dir("llama"))
    assert greedy_tokens(memory_model) == greedy_tokens(str(tiny_model_dir("llama")))


def test_a_truncated_or_half_copied_cache_is_copied_again(tiny_model_dir: Callable[..., Path],
                                                          cache: Path) -> None:
    local = tiny_model_dir("llama")
    url = local.as_uri()
    first = sources.fetch(url)
    assert first.copied
    weights = first.path / "model.safetensors"
    with open(weights, "r+b") as f:  # a copy cut short
        f.truncate(weights.stat().st_size // 2)
    again = sources.fetch(url)
    assert again.copied and files(again.path) == files(local)
    # a copy that died before its manifest (an older writer, a file copied by hand), and a
    # crashed copy's temp folder: both go, the copy is redone
    (again.path / sources.MANIFEST).unlink()
    leftover = cache / f".{again.path.name}.tmp-1-dead"
    leftover.mkdir()
    third = sources.fetch(url)
    assert third.copied and files(third.path) == files(local) and not leftover.exists()
    assert greedy_tokens(url) == greedy_tokens(str(local))


def test_a_replaced_source_is_copied_again(tmp_path: Path, cache: Path) -> None:
    src = tmp_path / "m"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "a.bin").write_bytes(b"x" * 10)
    assert sources.fetch(src.as_uri()).copied
    (src / "a.bin").write_bytes(b"y" * 20)
    out = sources.fetch(src.as_uri())
    assert out.copied and (out.path / "a.bin").read_bytes() == b"y" * 20
    (src / "b.bin").write_bytes(b"z")
    assert sources.fetch(src.as_uri()).copied and not sources.fetch(src.as_uri()).copied


def test_errors_name_the_url(tmp_path: Path, cache: Path) -> None:
    (tmp_path / "no-config").mkdir()
    (tmp_path / "no-config" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="no config.json"):
        sources.fetch((tmp_path / "no-config").as_uri())
    with pytest.raises(ValueError, match="cannot read.*no files"):
        sources.fetch((tmp_path / "nowhere").as_uri())
    with pytest.raises(ValueError, match="cannot read"):
        sources.fetch("nosuchprotocol42://bucket/model")


def test_an_unreachable_source_uses_a_complete_cache(tmp_path: Path, cache: Path) -> None:
    src = tmp_path / "m"
    src.mkdir()
    (src / "config.json").write_text("{}")
    url = src.as_uri()
    path = sources.fetch(url).path
    (src / "config.json").unlink()
    src.rmdir()
    assert sources.fetch(url) == sources.Fetched(path, copied=False)


_FETCH = """
import json, sys
from batchgen_data.models import sources
out = sources.fetch(sys.argv[1], sys.argv[2])
print(json.dumps({"path": str(out.path), "copied": out.copied}))
"""


def _blocked_on(lock: Path) -> int:
    """How many flock waiters /proc/locks shows on `lock` (Linux)."""
    inode = os.stat(lock).st_ino
    lines = Path("/proc/locks").read_text().splitlines()
    return sum(1 for ln in lines if "->" in ln and "FLOCK" in ln
               and ln.split()[-3].rsplit(":", 1)[-1] == str(inode))


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="needs Linux's /proc/locks")
def test_concurrent_processes_copy_once(tiny_model_dir: Callable[..., Path],
                                        tmp_path: Path) -> None:
    import fcntl

    url, cache_dir = tiny_model_dir("llama").as_uri(), tmp_path / "node-cache"
    target = sources.cache_path(url, cache_dir)
    cache_dir.mkdir()
    lock = target.with_name(target.name + ".lock")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # every process finds no copy, then queues here
        procs = [subprocess.Popen([sys.executable, "-c", _FETCH, url, str(cache_dir)],
                                  stdout=subprocess.PIPE, text=True, env=env)
                 for _ in range(4)]
        deadline = time.monotonic() + 60
        while _blocked_on(lock) < len(procs):
            assert time.monotonic() < deadline, "the processes never queued on the lock"
            assert all(p.poll() is None for p in procs)
            time.sleep(0.05)
        fcntl.flock(held, fcntl.LOCK_UN)
    outs = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert {o["path"] for o in outs} == {str(target)}
    assert sorted(o["copied"] for o in outs) == [False, False, False, True]
    assert files(target) == files(tiny_model_dir("llama"))
    assert [p.name for p in cache_dir.iterdir() if p.name.startswith(".")] == []
