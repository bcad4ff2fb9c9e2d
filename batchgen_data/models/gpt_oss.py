"""gpt-oss (`GptOssForCausalLM`, gpt-oss-20b / -120b), as HF's `modeling_gpt_oss.py`.

Llama's decoder with:
- attention biased on q, k, v and o (`attention_bias`), an attention sink per query head (a
  learned logit in every softmax's denominator, `Attention(sinks=True)`) and, per
  `layer_types`, a 128-token sliding window on every other layer (`DecoderShape.windows`);
- YaRN rope over whole heads with an unrounded correction range (`truncate: false`);
- every layer a `GptOssMoE` (`layers/gpt_oss_moe.py`): a biased router, softmax over the top-4
  logits, experts with biases and a clamped SwiGLU, their weights MXFP4 blocks and E8M0 scales as
  the checkpoint stores them (`layers/mxfp4.py`).
Checkpoint names differ from our modules in one place: a sink is `self_attn.sinks` there and
the attention layer's `self_attn.attn.sinks` here (`checkpoint_name`).
"""
from __future__ import annotations

import re
from typing import Any

from torch import nn

from batchgen_data.layers.attention import Attention
from batchgen_data.layers.gpt_oss_moe import GptOssMoE
from batchgen_data.models.llama import DecoderShape
from batchgen_data.models.moe import MoeForCausalLM, MoeShape

_SINKS = re.compile(r"^(layers\.\d+\.self_attn)\.sinks$")


def _mxfp4(config: Any) -> bool:
    q = getattr(config, "quantization_config", None) or {}
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    return method == "mxfp4"


class GptOssForCausalLM(MoeForCausalLM):
    def __init__(self, config: Any) -> None:
        if not _mxfp4(config):
            raise ValueError("GptOssForCausalLM: only the MXFP4 checkpoints (quantization_config "
                             "quant_method='mxfp4', as released) are supported; a dequantized "
                             "BF16 copy stores its experts stacked and transposed, which the "
                             "loader does not read for this model")
        super().__init__(config)
        if self.shape.tp.size > 1:
            raise ValueError("GptOssForCausalLM with tensor_parallel_size > 1: its MXFP4 experts "
                             "are not split over ranks")
        # the same attention layers with a sink logit per query head (filled by the loader)
        for i, layer in enumerate(self.layers):
            a = layer.self_attn.attn
            layer.self_attn.attn = Attention(a.num_heads, a.num_kv_heads, a.head_dim, a.scale, i,
                                             sliding_window=a.sliding_window, sinks=True)
        self.moe_layers = [layer.mlp for layer in self.layers]

    @staticmethod
    def moe_shape(config: Any) -> MoeShape:
        return MoeShape(config.num_local_experts, config.num_experts_per_tok,
                        config.intermediate_size, True)

    def make_mlp(self, config: Any, shape: DecoderShape, layer_idx: int) -> nn.Module:
        m = self.moe
        return GptOssMoE(shape.hidden, m.intermediate, m.num_experts, m.top_k,
                         float(config.swiglu_alpha), float(config.swiglu_limit))

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """A checkpoint's sink (`self_attn.sinks`) as our attention layer holds it."""
        return _SINKS.sub(r"\1.attn.sinks", name)
