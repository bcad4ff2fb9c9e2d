"""Compile every kernel for an H100/H200 (sm_90) ahead of time, on a machine without a GPU,
in bfloat16 (the CUDA default, which the interpreter cannot run) and, for the kernels that take
a compute dtype from their inputs (attention, the MoE GEMM), also in float16.

The interpreter runs kernels as numpy code and accepts things the GPU compiler rejects (dot
shapes, dtype mixing in loop bounds, shared-memory use). Triton ships its own ptxas, so the full
compile pipeline runs here; this catches those errors before a GPU ever sees the code.
It runs in a subprocess because this test session already imported triton in interpreter mode.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia.compiler")

_SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from batchgen_data.kernels import (activation, attention, fused_moe, kv_cache, moe_align,
                                       rmsnorm, rotary)
    from batchgen_data.kernels._attention_checks import prefill_tiles
    from batchgen_data.kernels._checks import tile

    FP32_SCALARS = {"scale_log2", "cap_log2", "eps", "v_factor", "inv_k_scale", "inv_v_scale"}

    def compile_sm90(fn, pointers, constexprs, **options):
        # Unlisted non-constexpr args are int32 scalars, as the launchers pass them.
        sig = {}
        for name in fn.arg_names:
            if name in constexprs:
                sig[name] = "constexpr"
            elif name in pointers:
                sig[name] = "*" + pointers[name]
            else:
                sig[name] = "fp32" if name in FP32_SCALARS else "i32"
        return triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", 90, 32),
                              options=options)

    # bf16 is the CUDA default dtype; fp16 where a kernel's dots or casts differ by dtype
    # and each attention kernel over an FP8 KV cache too (e4m3 codes read as bytes)
    for dt in ("bf16", "fp16"):
        for fp8 in (False, True):
            cache = "u8" if fp8 else dt
            attn = dict(q_ptr=dt, k_cache_ptr=cache, v_cache_ptr=cache, out_ptr=dt,
                        bt_ptr="i32", seq_lens_ptr="i32", cu_seqlens_ptr="i32",
                        part_acc_ptr="fp32", part_m_ptr="fp32", part_l_ptr="fp32",
                        sinks_ptr="fp32")
            # sinks and soft-capping (gpt-oss, Gemma 2) with the FP8 cache, plain without
            extra = dict(SINKS=fp8, SOFTCAP=fp8)
            compile_sm90(attention._decode_kernel, attn, dict(
                GROUP=4, NUM_SPLITS=4, BLOCK_G=16, BLOCK_N=64, BLOCK_D=128,
                DOT_PRECISION="tf32", FP8=fp8, **extra))
            compile_sm90(attention._decode_merge_kernel, attn,
                         dict(NUM_SPLITS=4, BLOCK_SPLITS=4, BLOCK_D=128, FP8=fp8,
                              SINKS=fp8))
            # the launcher's tiles for a GQA group of 3 and for MLA (head dim 576, 128 heads):
            # shared memory well under the H200's 228 KB
            for dim, group in ((128, 3), (576, 128)):
                t = prefill_tiles(dim, group, 4096, 2)
                kernel = compile_sm90(attention._prefill_kernel, attn, dict(
                    GROUP=group, HEADS=t.heads, H_BLOCKS=-(-group // t.heads),
                    POSITIONS=t.positions, ROWS=t.rows, BLOCK_N=t.block_n, BLOCK_D=tile(dim),
                    DOT_PRECISION="tf32", FP8=fp8, **extra), num_warps=t.num_warps)
                assert kernel.metadata.shared <= 100 * 1024, (dim, group, kernel.metadata.shared)
        moe = dict(a_ptr=dt, b_ptr=dt, c_ptr=dt, weights_ptr="fp32", sorted_ptr="i32",
                   expert_ids_ptr="i32", total_ptr="i32")
        for gated, block_m in ((True, 16), (False, 64)):  # gate/up at decode, down at prefill
            compile_sm90(fused_moe._moe_gemm_kernel, moe, dict(
                A_PER_TOKEN=gated, GATED=gated, ROUTED_WEIGHT=not gated, BLOCK_M=block_m,
                BLOCK_N=64 if gated else 128, BLOCK_K=64, GROUP_M=8, DOT_PRECISION="tf32"),
                num_warps=8 if block_m == 64 else 4, num_stages=3)
    align = dict(ids_ptr="i64", counts_ptr="i32", expert_ids_ptr="i32", total_ptr="i32",
                 sorted_ptr="i32", base_ptr="i32")
    compile_sm90(moe_align._count_kernel, align, dict(SUB=64, BLOCK_E=128))
    compile_sm90(moe_align._scan_kernel, align, dict(BLOCK_E=128, BLOCK_B=64))
    compile_sm90(moe_align._scatter_kernel, align, dict(SUB=64, BLOCK_E=128))
    compile_sm90(rmsnorm._rms_norm_kernel,
                 dict(x_ptr="bf16", res_ptr="bf16", w_ptr="bf16", out_ptr="bf16"),
                 dict(ADD_RESIDUAL=True, BLOCK=1024))
    compile_sm90(rotary._rotary_kernel,
                 dict(q_ptr="bf16", k_ptr="bf16", pos_ptr="i64", cache_ptr="fp32"),
                 dict(HALF=64, BLOCK_HQ=32, BLOCK_HK=8, BLOCK_R=64))
    for cache in ("bf16", "u8"):  # a bf16 cache, an FP8 one (codes rounded in the kernel)
        compile_sm90(kv_cache._write_kv_kernel,
                     dict(k_ptr="bf16", v_ptr="bf16", k_cache_ptr=cache, v_cache_ptr=cache,
                          slot_ptr="i64"),
                     dict(BLOCK_H=8, BLOCK_D=128, FP8=cache == "u8"))
    compile_sm90(activation._silu_and_mul_kernel, dict(x_ptr="bf16", out_ptr="bf16"),
                 dict(BLOCK=1024))
    print("ok")
    """
)


def test_all_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences a 3.9 deprecation warning
    result = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().endswith("ok")
