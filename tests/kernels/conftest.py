"""Shared setup for the Triton kernel tests: run kernels on CPU tensors through the interpreter.

TRITON_INTERPRET must be in the environment before triton (and so any kernel module) is first
imported, because ``@triton.jit`` decides at decoration time whether to interpret.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _launcher_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launchers' argument checks run in debug mode only; their tests need them."""
    from batchgen_data.kernels import _checks

    monkeypatch.setattr(_checks, "ENABLED", True)
