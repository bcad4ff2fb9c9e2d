"""The GPU kernel self-check (`python -m batchgen_data.kernels.selfcheck`) run here through the
Triton interpreter on small fp32 shapes: its cases compute what they claim (the kernels agree
with the references within fp32 rounding), and without CUDA it says so and exits 2."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from batchgen_data.kernels import selfcheck  # noqa: E402

CPU = torch.device("cpu")


@pytest.mark.parametrize("dim,group,ctx", [(64, 1, 40), (32, 4, 19)])
def test_attention_cases(dim: int, group: int, ctx: int) -> None:
    assert selfcheck.case_decode(torch.float32, dim, group, ctx, CPU) < 1e-4
    assert selfcheck.case_prefill(torch.float32, dim, group, ctx, CPU) < 1e-4


def test_window_sink_softcap_cases() -> None:
    win = dict(sliding_window=16, sinks=True, softcap=5.0)
    assert selfcheck.case_decode(torch.float32, 32, 2, 40, CPU, **win) < 1e-4
    assert selfcheck.case_prefill(torch.float32, 32, 2, 40, CPU, **win) < 1e-4


def test_the_other_cases() -> None:
    assert selfcheck.case_write_kv(torch.float32, 32, CPU) == 0.0
    assert selfcheck.case_moe(torch.float32, 5, CPU) < 1e-4
    assert selfcheck.case_sampler(24, CPU) == 0.0  # the kernel's draws are the reference's


def test_rel_err_is_relative_to_the_largest_value() -> None:
    want = torch.tensor([1e-3, -2e-3])
    assert selfcheck.rel_err(want * 1.01, want) == pytest.approx(0.01, rel=1e-3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")
def test_without_cuda_it_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert selfcheck.main(["--quick"]) == 2
    assert "no CUDA device" in capsys.readouterr().out
