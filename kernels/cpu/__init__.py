"""C kernels for the CPU (fp32), with their builder and checked launchers.

The sources are in `csrc/` (plain C, no torch headers); `build.library()` compiles them once per
machine with the system C compiler and loads them through ctypes, or returns None (no compiler,
a failed build) so every caller keeps its torch path, for the ISA level `isa.py` reads from the
CPU's flags under its cap. `capability.py` says what this CPU kind runs (the built kernels',
oneDNN's and torch's answers); every CPU-dependent choice asks it.
Launchers validate shapes and dtypes:
    attention.py  decode attention straight from the paged KV cache
    ops.py        residual add + RMSNorm, the rotary embedding, SiLU * up
    linear.py     matmuls on the oneDNN, panel and plain weight layouts
    moe.py        an MoE layer's routed experts in one call (few tokens, AVX2)
    lora.py       the LoRA deltas of one linear layer for many adapters in one call (AVX2)
Nothing here knows about models: a whole-model C step (the runner's decode stack,
`batchgen_data/worker/fast_paths/csrc/`) lives with its fast path and is built over these kernels
by `build.extension`.
"""
