"""Shared fixtures: tiny random-initialised HF models (Llama / Qwen2 / Qwen3) with a small
trained BPE tokenizer and a ChatML template, saved to temp dirs once per test session.

HF `generate` on the same weights is the oracle for our engine's greedy outputs.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterator

import pytest

from local_ray import start_local_ray

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton kernels run on CPU tensors only under the interpreter; it must be set before import.
os.environ.setdefault("TRITON_INTERPRET", "1")

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Classify the sentiment of this review: the battery died after two days.",
    "Summarise the following paragraph in one sentence.",
    "Extract the invoice number, the date and the total amount as JSON.",
    "What is the capital of France? Paris is the capital of France.",
    "def add(a, b):\n    return a + b\n",
    "Write a short poem about the sea, the wind and the evening light.",
    "Judge whether the answer is correct and explain why in two sentences.",
] * 20


def build_tokenizer(path: Path):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(path)
    return fast


def build_tiny_model(arch: str, path: Path, vocab_size: int, **overrides) -> Path:  # type: ignore[no-untyped-def]
    import torch
    import transformers as tf

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=1024, eos_token_id=2, bos_token_id=0, pad_token_id=0)
    common.update(overrides)
    if arch == "llama":
        cfg = tf.LlamaConfig(tie_word_embeddings=False, **common)
        cls = tf.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(tie_word_embeddings=True, **common)
        cls = tf.Qwen2ForCausalLM
    elif arch == "mistral":
        common.setdefault("sliding_window", None)  # the shared tiny Mistral is global
        cfg = tf.MistralConfig(tie_word_embeddings=False, **common)
        cls = tf.MistralForCausalLM
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(tie_word_embeddings=False, head_dim=32, **common)
        cls = tf.Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed({"llama": 1, "qwen2": 2, "qwen3": 3, "mistral": 4}[arch])
    model = cls(cfg).eval()
    # random init gives near-flat logits; widen them so greedy ties are vanishingly rare
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    """Tests that pin torch to one thread (to share the CPU) must not leave later tests, which
    may check a split over threads, on one thread too."""
    import torch

    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: tiny_model_dir("llama" | "qwen2" | "qwen3" | "mistral") -> saved model dir
    (cached)."""
    cache: dict[str, Path] = {}

    def make(arch: str = "llama") -> Path:
        if arch not in cache:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            tok = build_tokenizer(path)
            build_tiny_model(arch, path, vocab_size=len(tok))
            cache[arch] = path
        return cache[arch]

    return make


@pytest.fixture(scope="session")
def hf_model() -> Callable[[Path], object]:
    """Load the HF reference model (fp32, eval) for a tiny model dir, cached per dir."""
    cache: dict[Path, object] = {}

    def load(path: Path):  # type: ignore[no-untyped-def]
        if path not in cache:
            from transformers import AutoModelForCausalLM
            cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
        return cache[path]

    return load


@pytest.fixture(scope="session")
def ray_local() -> Iterator[None]:
    """A local 2-CPU Ray with Ray Data's progress output off."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():  # a module that used another cluster may have restarted it
        start_local_ray()
    yield
    ray.shutdown()
