"""The project as a cluster gets it: a wheel built from a copy of the sources (the checkout is
never touched), installed with `pip --no-deps --target` into a folder of its own.

Shared by tests/unit/test_wheel.py (imports every module of it in an interpreter that cannot see
the checkout) and the two-node Ray tests (whose nodes get its `batchgen_data` folder through
`runtime_env={"py_modules": [...]}`). A plain module, not a conftest: tests import it by name
(tests/ is on sys.path through tests/conftest.py).
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# source folder -> the package it installs as (pyproject's package-dir)
SOURCE_ROOTS = {"batchgen_data": "batchgen_data", "kernels": "batchgen_data.kernels",
                "connectors": "batchgen_data.connectors"}


def build_wheel(work: Path) -> Path:
    """`pip wheel` of a copy of the sources under `work`; the path of the wheel."""
    src = work / "src"
    src.mkdir(parents=True)
    for name in (*SOURCE_ROOTS, "pyproject.toml", "README.md"):
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
        else:
            shutil.copy(path, src / name)
    subprocess.run([*_pip(), "wheel", "--no-deps", "--no-build-isolation", "-w",
                    str(work / "dist"), str(src)], check=True, timeout=300, capture_output=True)
    (wheel,) = (work / "dist").glob("batchgen_data-*.whl")
    return wheel


def install_wheel(wheel: Path, site: Path) -> Path:
    """The wheel's files under `site` (no dependencies, no index): `site/batchgen_data` is the
    installed package."""
    subprocess.run([*_pip(), "install", "--no-deps", "--no-index", "--target", str(site),
                    str(wheel)], check=True, timeout=300, capture_output=True)
    return site


def _pip() -> list[str]:
    return [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
