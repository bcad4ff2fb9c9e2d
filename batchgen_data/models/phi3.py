"""Phi-3 and Phi-4 (`Phi3ForCausalLM`): Llama's decoder as HF's `modeling_phi3.py` writes it.

What differs from Llama is where the weights sit and how positions rotate, not the layer:
- the checkpoint stores q|k|v as one `qkv_proj` and gate|up as one `gate_up_proj`, the fused
  layouts our layers run; the loader cuts them into their shards (`models/fused_weights.py`) so a
  tensor-parallel rank and a quantized stored form take them like any other checkpoint's;
- LongRoPE (`rope_type="longrope"`, Phi-3-128k, Phi-3.5, Phi-4-mini): short and long factor
  sets, chosen by the engine's `max_model_len` (`layers/long_rope.py`);
- `partial_rotary_factor` (Phi-4-mini rotates three quarters of each head,
  `layers/partial_rotary.py`);
- a `sliding_window` some releases set, read per layer by `DecoderShape` like Mistral's.
The MLP is SwiGLU with the gate rows first (HF chunks gate_up_proj into gate, up), as
`SiluAndMul` reads them; the residual dropouts are training-only. Being a `LlamaForCausalLM`,
it takes the engine paths the Llama family takes (the CPU decode stack where the rotation
covers whole heads, tensor parallelism, quantized checkpoints).
"""
from __future__ import annotations

from typing import Any

from batchgen_data.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any) -> None:
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Phi3ForCausalLM with hidden_act={act!r}: only 'silu' (SwiGLU) "
                             "is supported")
        super().__init__(config)
