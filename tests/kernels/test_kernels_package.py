"""The kernels package imports and reports cleanly without triton; launchers load lazily."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import batchgen_data.kernels as kernels


def test_launchers_listed_and_lazy() -> None:
    expected = {
        "paged_decode_attention", "paged_prefill_attention", "write_kv_cache", "rms_norm",
        "fused_add_rms_norm", "apply_rotary", "silu_and_mul", "moe_align_block_size", "fused_experts",
        "lora_shrink", "lora_expand", "quant_linear", "per_token_group_quant_fp8",
        "fp8_block_matmul", "fp8_block_matmul_quantized", "mxfp4_linear",
        "triton_available",
    }
    assert set(kernels.__all__) == expected
    assert isinstance(kernels.triton_available(), bool)


def test_unknown_attribute_raises_attribute_error() -> None:
    try:
        kernels.not_a_kernel  # noqa: B018
    except AttributeError as exc:
        assert "not_a_kernel" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_import_without_triton() -> None:
    # A None entry in sys.modules makes `import triton` raise ImportError, as if not installed.
    code = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None
        import torch
        from batchgen_data.kernels import reference, triton_available
        assert triton_available() is False
        x = torch.randn(2, 8)
        assert reference.silu_and_mul(x).shape == (2, 4)
        try:
            from batchgen_data.kernels import rms_norm
        except ImportError:
            pass
        else:
            raise SystemExit("launcher imported without triton")
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
