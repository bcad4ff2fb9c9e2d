"""Tiny random vision-language checkpoints for tests and benchmarks: a Qwen2.5-VL model with
its HF processor (the PIL image processor and a small BPE tokenizer holding Qwen's vision
tokens), saved to a directory as `save_pretrained` writes it, and images made with numpy."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


@dataclass(frozen=True)
class Image:
    """What the engine takes of one image (the fields of inputs/images.py's ImageInput)."""

    hash: str
    pixel_values: Any
    grid_thw: tuple[int, int, int]
    num_tokens: int
    offset: int
    extra: dict = field(default_factory=dict)


def _save(path: Path, tok, cfg, model_cls, patch_size: int, seed: int) -> Path:  # type: ignore[no-untyped-def]
    import torch
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # random init gives near-flat logits: widen them against ties
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.save_pretrained(path)
    side = 8 * patch_size
    Qwen2VLImageProcessorPil(patch_size=patch_size, min_pixels=4 * patch_size ** 2,
                             max_pixels=side * side).save_pretrained(path)
    return path


def _tokenizer(path: Path):  # type: ignore[no-untyped-def]
    from tests.conftest import build_tokenizer

    tok = build_tokenizer(path)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.save_pretrained(path)
    return tok


def _token_ids(tok) -> dict[str, int]:  # type: ignore[no-untyped-def]
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    return dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                vision_start_token_id=ids["<|vision_start|>"],
                vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)


def _text(tok, **extra) -> dict:  # type: ignore[no-untyped-def]
    return dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=1024, rms_norm_eps=1e-6,
                eos_token_id=tok.eos_token_id, bos_token_id=0, pad_token_id=0, **extra)


def build_qwen2_5_vl(path: Path, seed: int = 5) -> Path:
    """14-pixel patches, windows of 56 pixels (2x2 merged tokens), full attention in block 1."""
    import transformers as tf

    tok = _tokenizer(path)
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                  fullatt_block_indexes=[1], out_hidden_size=64, hidden_act="silu")
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    cfg = tf.Qwen2_5_VLConfig(vision_config=vision, text_config=_text(tok, rope_parameters=rope),
                              **_token_ids(tok))
    return _save(path, tok, cfg, tf.Qwen2_5_VLForConditionalGeneration, 14, seed)


def build_qwen3_vl(path: Path, seed: int = 6) -> Path:
    """16-pixel patches, a 4x4 learned position table, DeepStack from blocks 0 and 1."""
    import transformers as tf

    tok = _tokenizer(path)
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                  num_position_embeddings=16, deepstack_visual_indexes=[0, 1],
                  hidden_act="gelu_pytorch_tanh")
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
            "mrope_interleaved": True}
    cfg = tf.Qwen3VLConfig(vision_config=vision,
                           text_config=_text(tok, head_dim=16, rope_parameters=rope),
                           **_token_ids(tok))
    return _save(path, tok, cfg, tf.Qwen3VLForConditionalGeneration, 16, seed)


def processor(path: Path, family: str) -> Any:
    import transformers as tf
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    base = {"qwen2_5_vl": tf.Qwen2_5_VLProcessor, "qwen3_vl": tf.Qwen3VLProcessor}[family]

    class ImagesOnly(base):  # type: ignore[misc, valid-type]
        """HF's processor without a video processor (those need torchvision, not installed):
        the class check of the absent one is skipped; images and text go through HF's code."""

        def check_argument_for_proper_class(self, name: str, arg: Any) -> Any:
            return None if arg is None else super().check_argument_for_proper_class(name, arg)

    return ImagesOnly(image_processor=Qwen2VLImageProcessorPil.from_pretrained(path),
                      tokenizer=tf.AutoTokenizer.from_pretrained(path))


def make_image(seed: int, size: tuple[int, int]) -> Any:
    """A random RGB picture (width, height) with some structure, made with numpy."""
    from PIL import Image as PILImage

    rng = np.random.default_rng(seed)
    w, h = size
    base = rng.integers(0, 256, size=(h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
    big = np.kron(base, np.ones((8, 8, 1), dtype=np.uint8))[:h, :w]
    noise = rng.integers(0, 32, size=(h, w, 3), dtype=np.uint8)
    return PILImage.fromarray(big + noise)


def image_prompt(text: str, n_images: int) -> str:
    return "".join("<|vision_start|><|image_pad|><|vision_end|>" for _ in range(n_images)) + text


def engine_images(batch: Any, image_token_id: int, hashes: list[str]) -> list[Image]:
    """The processor's output for one prompt (batch of one) as the engine takes its images."""
    grids = [tuple(int(v) for v in g) for g in batch["image_grid_thw"]]
    ids = batch["input_ids"][0].tolist()
    starts = [i for i, t in enumerate(ids)
              if t == image_token_id and (i == 0 or ids[i - 1] != image_token_id)]
    out, at = [], 0
    for g, start, h in zip(grids, starts, hashes):
        n = g[0] * g[1] * g[2]
        out.append(Image(h, batch["pixel_values"][at:at + n], g, n // 4, start))
        at += n
    return out
