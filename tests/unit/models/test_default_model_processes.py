"""One conversion of the default model per node, with real processes (not threads): the
`flock` and the atomic rename of `default_model.default_model_dir` as Ray actors or Spark
workers starting together on one node meet them.

* N interpreters released at the same instant against an empty cache: exactly one converts,
  the others wait on the lock and load its directory;
* a conversion SIGKILLed half way (its files half written in its temp folder): the kernel
  drops its lock, nothing under the published name exists, and the next two processes, again
  released at once, find the leftover, remove it and convert once.

The conversion itself is a stand-in that writes the required files slowly, piece by piece, and
appends one line per conversion to a shared file (the real one takes ~30 s and is run by
test_default_model.py); the lock, the processes and the kill are real.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchgen_data import env
from batchgen_data.models import default_model as dm

N_PROCESSES = 4

# argv: cache dir, a file to wait for (all children are released together; each says it is up
# with a `.ready.PID` file beside it), the conversion
# log, seconds to spend per file, and "hang" to stop half way (the test kills it there)
_CHILD = """
import json, os, sys, time
from pathlib import Path
import batchgen_data.models.default_model as dm
cache, go, conversions, per_file, mode = sys.argv[1:6]
def slow_convert(gguf, out_dir):
    with open(conversions, "a") as f:
        f.write(f"{os.getpid()}\\n")
    for i, name in enumerate(dm._REQUIRED_FILES):
        with open(Path(out_dir) / name, "wb") as f:
            f.write(b"x" * 4096)
            f.flush()
            if mode == "hang" and i == len(dm._REQUIRED_FILES) // 2:
                Path(conversions + ".half").write_text(str(out_dir))
                time.sleep(600)  # killed here: this file half written, the rest missing
            f.write(b"y" * 4096)
        time.sleep(float(per_file))
dm._convert = slow_convert
Path(f"{go}.ready.{os.getpid()}").touch()
while not os.path.exists(go):
    time.sleep(0.005)
t0 = time.monotonic()
path = dm.default_model_dir(cache)
print(json.dumps({"path": str(path), "waited_s": time.monotonic() - t0}))
"""


def start(cache: Path, go: Path, conversions: Path, per_file: float = 0.2,
          mode: str = "normal") -> subprocess.Popen:
    child_env = {k: v for k, v in os.environ.items() if k != env.CACHE_DIR_VAR}
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(cache), str(go),
                             str(conversions), str(per_file), mode], env=child_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(procs: list[subprocess.Popen]) -> list[dict]:
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def released_together(cache: Path, work: Path, n: int) -> tuple[list[dict], list[str]]:
    """n children, all released by one file once their interpreters are up."""
    go, conversions = work / "go", work / "conversions"
    for old in (go, conversions, *work.glob("go.ready.*")):
        old.unlink(missing_ok=True)
    procs = [start(cache, go, conversions) for _ in range(n)]
    deadline = time.monotonic() + 120
    while len(list(work.glob("go.ready.*"))) < n:  # every interpreter is up and polls `go`
        assert all(p.poll() is None for p in procs), [p.communicate()[1][-2000:] for p in procs]
        assert time.monotonic() < deadline, "the children never started"
        time.sleep(0.02)
    go.touch()
    results = finish(procs)
    return results, conversions.read_text().split()


def published(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir())


def test_processes_starting_at_once_convert_once(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    results, conversions = released_together(cache, tmp_path, N_PROCESSES)
    assert len(conversions) == 1, conversions  # one converted, the others waited
    paths = {r["path"] for r in results}
    assert len(paths) == 1
    target = Path(paths.pop())
    assert dm._is_complete(target)
    # the waiters waited for the converter (its five files take ~1 s), then loaded its dir
    assert sorted(r["waited_s"] > 0.8 for r in results).count(True) >= N_PROCESSES - 1
    assert published(cache) == sorted([target.name, f"{target.name}.lock"])


def test_a_conversion_killed_half_way_is_detected_and_redone(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    go, conversions = tmp_path / "go", tmp_path / "conversions"
    go.touch()
    victim = start(cache, go, conversions, mode="hang")
    half = Path(str(conversions) + ".half")
    deadline = time.monotonic() + 60
    while not half.exists():
        assert victim.poll() is None, victim.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the conversion never got half way"
        time.sleep(0.02)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    tmp = Path(half.read_text())
    # half written: some files, one cut short, in the temp folder; nothing published
    assert tmp.is_dir() and not dm._is_complete(tmp)
    target = cache / tmp.name[1:].split(".tmp-")[0]
    assert not target.exists()
    results, redone = released_together(cache, tmp_path, 2)
    assert len(redone) == 1, redone
    assert {r["path"] for r in results} == {str(target)} and dm._is_complete(target)
    for name in dm._REQUIRED_FILES:  # every file whole: written by the new conversion
        assert (target / name).stat().st_size == 8192, name
    assert not tmp.exists()  # the killed one's leftovers are gone
    assert published(cache) == sorted([target.name, f"{target.name}.lock"])


@pytest.fixture(autouse=True)
def _gguf_present() -> None:
    try:
        dm.find_default_gguf()
    except RuntimeError as e:
        pytest.skip(str(e))
