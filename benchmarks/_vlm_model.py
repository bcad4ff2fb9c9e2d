"""A Qwen2.5-VL-shaped checkpoint with random weights for `vlm_throughput.py`: the model
(`save_pretrained`), a small trained BPE tokenizer holding Qwen's vision tokens with a ChatML
template that renders image parts as Qwen's `<|vision_start|><|image_pad|><|vision_end|>`, and
the PIL image processor, laid out as a downloaded checkpoint is."""
from __future__ import annotations

from pathlib import Path

VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QUESTIONS = ["Describe the picture in one sentence.", "What is written on the label?",
             "Extract the invoice number and the total as JSON.", "Compare the two photos.",
             "Which product is shown, and what colour is it?"]
# (vision depth, vision hidden, text hidden, text layers, heads, kv heads)
SIZES = {"tiny": (2, 32, 64, 2, 4, 2), "small": (4, 128, 256, 4, 8, 2)}


def build_model(path: Path, size: str = "small", seed: int = 7) -> Path:
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *VISION_TOKENS]
    tok.train_from_iterator(QUESTIONS * 50, trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                      pad_token="<|endoftext|>")
    fast.chat_template = VL_TEMPLATE
    ids = {t: fast.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    depth, v_hidden, hidden, layers, heads, kv = SIZES[size]
    head_dim = hidden // heads
    half = head_dim // 2  # M-RoPE sections over the head's frequency pairs (t, h, w)
    section = [half - 2 * (half // 4 + half // 8), half // 4 + half // 8, half // 4 + half // 8]
    vision = dict(depth=depth, hidden_size=v_hidden, intermediate_size=2 * v_hidden,
                  num_heads=max(2, v_hidden // 32), patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=56, fullatt_block_indexes=[depth - 1],
                  out_hidden_size=hidden, hidden_act="silu")
    text = dict(vocab_size=len(fast), hidden_size=hidden, intermediate_size=2 * hidden,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                max_position_embeddings=4096, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": section},
                eos_token_id=fast.eos_token_id, bos_token_id=0, pad_token_id=0)
    cfg = tf.Qwen2_5_VLConfig(vision_config=vision, text_config=text,
                              image_token_id=ids["<|image_pad|>"],
                              video_token_id=ids["<|video_pad|>"],
                              vision_start_token_id=ids["<|vision_start|>"],
                              vision_end_token_id=ids["<|vision_end|>"],
                              tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = tf.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # random init gives near-flat logits: widen them against ties
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=224 * 224).save_pretrained(path)
    return path
