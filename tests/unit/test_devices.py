"""batchgen_data/devices.py: the one device picker (offline, Ray actor, Spark task)."""
from __future__ import annotations

import pytest

from batchgen_data.devices import pick_device


@pytest.mark.parametrize("requested, gpus, visible, cuda, expected", [
    ("auto", None, None, True, "cuda"),      # offline: any GPU this process sees
    ("auto", None, None, False, "cpu"),
    ("auto", [], "", True, "cpu"),           # Ray actor given no GPU (Ray empties the mask)
    ("auto", [2], "2", True, "cuda:0"),      # Ray actor given GPU 2: the only visible device
    ("auto", ["3"], "2,3", True, "cuda:1"),  # Spark address inside CUDA_VISIBLE_DEVICES
    ("cpu", ["0"], None, True, "cpu"),       # the user's choice is kept
    ("cuda:1", None, None, True, "cuda:1"),
])
def test_pick_device(requested: str, gpus: list | None, visible: str | None, cuda: bool,
                     expected: str) -> None:
    assert pick_device(requested, gpus, visible, cuda) == expected


def test_cuda_asked_for_without_cuda_is_an_error() -> None:
    with pytest.raises(ValueError, match="device='cuda:0': CUDA is not available"):
        pick_device("cuda:0", cuda_available=False)
