"""batchgen_data/worker/devices.py: the one device picker (offline, Ray actor, Spark task), the
resolved device index, and the device scope the engine enters (fake multi-GPU via monkeypatch)."""
from __future__ import annotations

import pytest
import torch

from batchgen_data.worker import devices
from batchgen_data.worker.devices import device_scope, pick_device, resolve_device


@pytest.mark.parametrize("requested, gpus, visible, cuda, expected", [
    ("auto", None, None, True, "cuda"),      # offline: any GPU this process sees
    ("auto", None, None, False, "cpu"),
    ("auto", [], "", True, "cpu"),           # Ray actor given no GPU (Ray empties the mask)
    ("auto", [2], "2", True, "cuda:0"),      # Ray actor given GPU 2: the only visible device
    ("auto", ["3"], "2,3", True, "cuda:1"),  # Spark address inside CUDA_VISIBLE_DEVICES
    ("auto", ["1"], None, True, "cuda:1"),   # Spark, CUDA_VISIBLE_DEVICES unset: all GPUs seen
    ("cpu", ["0"], None, True, "cpu"),       # the user's choice is kept
    ("cuda:1", None, None, True, "cuda:1"),
])
def test_pick_device(requested: str, gpus: list | None, visible: str | None, cuda: bool,
                     expected: str) -> None:
    assert pick_device(requested, gpus, visible, cuda) == expected


def test_cuda_asked_for_without_cuda_is_an_error() -> None:
    with pytest.raises(ValueError, match="device='cuda:0': CUDA is not available"):
        pick_device("cuda:0", cuda_available=False)


@pytest.fixture
def four_gpus(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A fake 4-GPU process whose current device is 2; returns the devices entered."""
    entered: list[int] = []

    class FakeDeviceContext:
        def __init__(self, device: torch.device | int) -> None:
            self.index = device.index if isinstance(device, torch.device) else device

        def __enter__(self) -> None:
            entered.append(self.index)

        def __exit__(self, *exc: object) -> None:
            entered.append(-1)

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(torch.cuda, "device", FakeDeviceContext)
    return entered


def test_resolve_device_gives_cuda_an_index(four_gpus: list[int]) -> None:
    assert resolve_device("cuda") == torch.device("cuda", 2)  # the current device
    assert resolve_device("cuda:3") == torch.device("cuda", 3)
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="sees 4 CUDA device"):
        resolve_device("cuda:4")


def test_spark_gpu_one_with_no_mask_is_entered(four_gpus: list[int]) -> None:
    # a Spark task given GPU 1 on a node without CUDA_VISIBLE_DEVICES: the engine must make
    # cuda:1 current around its work, or Triton would launch on the current device (2 here)
    device = resolve_device(pick_device("auto", ["1"], None, cuda_available=True))
    with device_scope(device):
        assert four_gpus == [1]
    assert four_gpus == [1, -1]
    with device_scope(torch.device("cpu")):
        pass
    assert four_gpus == [1, -1]  # the CPU enters nothing


def test_the_runner_enters_its_device_for_every_forward(tiny_model_dir, four_gpus: list[int],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from batchgen_data import LLM, SamplingParams
    from batchgen_data.worker import model_runner

    llm = LLM(str(tiny_model_dir("qwen2")), max_num_seqs=2, max_model_len=64)
    runner = llm.engine.runner
    # pretend the engine lives on cuda:1; the forward still runs on the CPU tensors
    scopes: list[torch.device] = []

    def recording_scope(device: torch.device) -> object:
        scopes.append(device)
        return devices.device_scope(torch.device("cpu"))

    monkeypatch.setattr(model_runner, "device_scope", recording_scope)
    steps0 = llm.engine.stats.num_steps
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, temperature=0),
                 use_tqdm=False)
    assert len(scopes) == llm.engine.stats.num_steps - steps0 >= 4
    assert set(scopes) == {runner.device}


def test_graph_capture_enters_its_device(tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from batchgen_data import LLM
    from batchgen_data.worker.fast_paths import cuda_graphs

    llm = LLM(str(tiny_model_dir("qwen2")), max_num_seqs=2, max_model_len=64)
    runner = llm.engine.runner
    inside: list[bool] = []
    state = {"in": False}

    class Scope:
        def __enter__(self) -> None:
            state["in"] = True

        def __exit__(self, *exc: object) -> None:
            state["in"] = False

    def capture(forward, pool):  # type: ignore[no-untyped-def]
        inside.append(state["in"])
        return cuda_graphs.eager_capture(forward, pool)

    monkeypatch.setattr(cuda_graphs, "device_scope", lambda device: Scope())
    cuda_graphs.DecodeGraphs(runner.model, runner.kv_caches, 2, 64, runner.block_size,
                             runner.device, capture=capture)
    assert inside == [True, True]  # sizes 2 and 1, each captured inside the device scope


def test_cuda_indices_map_each_assigned_address_like_pick_device() -> None:
    assert devices.cuda_indices(["3", "5"], None) == [3, 5]
    assert devices.cuda_indices(["3", "5"], "2,3,4,5") == [1, 3]
    assert devices.cuda_indices([4], "4") == [0]
    for addrs, visible in ((["3"], "2,3"), (["1"], None), ([2], "2")):
        assert pick_device("auto", addrs, visible, True) == \
            f"cuda:{devices.cuda_indices(addrs, visible)[0]}"


def test_each_rank_on_its_device() -> None:
    """rank_device: a launcher's index (a Ray rank sees only its GPU) first, then the listed
    `rank_devices`, else consecutive from rank 0's device."""
    from batchgen_data.config import make_engine_config
    from batchgen_data.worker.tp.runner import rank_device

    cuda2, cpu = torch.device("cuda", 2), torch.device("cpu")
    assert [rank_device(cuda2, r) for r in (0, 1)] == [torch.device("cuda", 2),
                                                       torch.device("cuda", 3)]
    assert rank_device(torch.device("cuda", 0), 1) == torch.device("cuda", 1)
    assert rank_device(cuda2, 1, None, (3, 5)) == torch.device("cuda", 5)
    assert rank_device(cuda2, 1, 0, (3, 5)) == torch.device("cuda", 0)
    assert rank_device(cpu, 1, None, (3, 5)) == cpu
    assert make_engine_config("m", tensor_parallel_size=2, rank_devices=[3, 5]).rank_devices \
        == (3, 5)
    for bad, match in (([1], "2 distinct devices"), ([1, 1], "2 distinct devices"),
                       ([0, -1], "int >= 0"), ((0, True), "int >= 0")):
        with pytest.raises(ValueError, match=match):
            make_engine_config("m", tensor_parallel_size=2, rank_devices=bad)
    with pytest.raises(ValueError, match="Ray rank uses the GPU of its bundle"):
        make_engine_config("m", tensor_parallel_size=2, rank_devices=[0, 1],
                           distributed_executor_backend="ray")
