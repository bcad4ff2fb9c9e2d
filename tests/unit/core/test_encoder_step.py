"""The encoder as a scheduled step, with fake images (no model): the step's encoder batch
under its own budget, prompts suspended for their encoding, an image shared by many prompts
encoded once, outputs held until the prefill has read them, and prefix-cache keys that tell
images apart."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from batchgen_data.config import SchedulerConfig
from batchgen_data.core.encoder_cache import EncoderCache
from batchgen_data.core.kv.block_pool import BlockPool
from batchgen_data.core.kv.held_kv import HeldKVStore
from batchgen_data.core.multimodal import MultiModalPrompt, cache_keys, check_placeholders
from batchgen_data.core.scheduler import Scheduler
from batchgen_data.core.sequence import Sequence
from batchgen_data.sampling_params import SamplingParams

IMG = 99  # the image placeholder token
_ids = itertools.count()


@dataclass(frozen=True)
class Item:
    hash: str
    num_tokens: int
    offset: int
    pixel_values: object = None
    grid_thw: tuple[int, int, int] = (1, 2, 2)


class Rows:
    """Embedding rows standing in for a tower's output."""

    def __init__(self, n: int) -> None:
        self.shape = (n, 8)


def prompt_with(images: list[tuple[str, int]], text: int = 3, first: int = 1
                ) -> tuple[list[int], list[Item]]:
    """`text` tokens `first`, then each image's placeholders followed by `text` tokens."""
    ids, items = [first] * text, []
    for h, n in images:
        items.append(Item(h, n, len(ids)))
        ids += [IMG] * n + [2] * text
    return ids, items


def seq(images: list[tuple[str, int]], first: int = 1) -> Sequence:
    ids, items = prompt_with(images, first=first)
    offsets = check_placeholders(ids, IMG, items)
    mm = MultiModalPrompt(items, offsets, cache_keys(ids, offsets, items)) if items else None
    return Sequence(next(_ids), "r", 0, ids, SamplingParams(max_tokens=4), 0, 4, mm=mm)


def make(budget: int, tokens: int = 256, bs: int = 4) -> tuple[Scheduler, EncoderCache]:
    cfg = SchedulerConfig(max_num_batched_tokens=tokens, max_num_encoder_input_tokens=budget)
    sch = Scheduler(cfg, BlockPool(256, bs), HeldKVStore(1 << 30, 8))
    sch.encoder_cache = cache = EncoderCache(cfg.encoder_cache_rows)
    return sch, cache


def run(sch: Scheduler, cache: EncoderCache):  # type: ignore[no-untyped-def]
    """One step: the encoder batch stored, the prefill chunks computed."""
    out = sch.schedule()
    for item in out.encode:
        cache.put(item.hash, Rows(item.num_tokens))
    for s, n in zip(out.seqs, out.num_new_tokens):
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(7)
    sch.after_step(out)
    return out


def test_encoder_budget_batches_images_of_many_prompts() -> None:
    sch, cache = make(budget=20)
    a, b, c = seq([("x", 8)]), seq([("y", 8), ("z", 8)]), seq([("w", 8)])
    for s in (a, b, c):
        sch.add(s)
    out = run(sch, cache)
    # a's image fits, b's two do not: b waits, suspended for its encoding, and c behind it
    assert [it.hash for it in out.encode] == ["x"] and out.seqs == [a]
    out = run(sch, cache)
    assert [it.hash for it in out.encode] == ["y", "z"] and b in out.seqs and c not in out.seqs
    out = run(sch, cache)
    assert [it.hash for it in out.encode] == ["w"] and c in out.seqs
    assert cache.encoded == 4


def test_an_image_larger_than_the_budget_runs_alone() -> None:
    sch, cache = make(budget=4)
    big, small = seq([("big", 12)]), seq([("s", 2)])
    sch.add(big)
    sch.add(small)
    out = run(sch, cache)
    assert [it.hash for it in out.encode] == ["big"] and out.seqs == [big]
    out = run(sch, cache)
    assert [it.hash for it in out.encode] == ["s"]


def test_a_shared_image_is_encoded_once_and_held_until_read() -> None:
    sch, cache = make(budget=64, tokens=6)  # prefill chunks of 6 tokens at most
    a, b = seq([("logo", 8)]), seq([("logo", 8)], first=5)  # no prefix shared
    sch.add(a)
    sch.add(b)
    out = run(sch, cache)
    assert [it.hash for it in out.encode] == ["logo"] and out.seqs == [a]
    assert a.mm_held and "logo" in cache._users
    run(sch, cache)
    out = run(sch, cache)  # a is past its image now; b starts and finds it cached
    assert not a.mm_held and b.mm_held and out.encode == [] and cache.hits == 1
    while b.num_computed_tokens < b.mm.offsets[0] + 8:
        run(sch, cache)
    assert not b.mm_held and "logo" not in cache._users
    assert cache.encoded == 1


def test_unheld_outputs_are_evicted_past_capacity() -> None:
    cache = EncoderCache(10)
    cache.acquire("kept")
    cache.put("kept", Rows(8))
    cache.put("gone", Rows(4))
    assert cache.has("kept") and not cache.has("gone")
    cache.release("kept")
    cache.put("new", Rows(4))
    assert not cache.has("kept") and cache.has("new")


def test_prefix_cache_keys_tell_images_apart() -> None:
    sch, cache = make(budget=64, bs=4)
    first = seq([("cat", 8)])
    sch.add(first)
    while first.num_computed_tokens < first.num_prompt_tokens:
        run(sch, cache)
    same, other = seq([("cat", 8)]), seq([("dog", 8)])
    sch.add(same)
    sch.add(other)
    sch.schedule()
    assert same.num_cached_tokens == (same.num_prompt_tokens - 1) // 4 * 4
    assert other.num_cached_tokens == 0  # its first block already holds a placeholder


def test_placeholders_are_checked() -> None:
    ids, items = prompt_with([("a", 4), ("b", 4)])
    assert check_placeholders(ids, IMG, items) == [3, 10]
    with pytest.raises(ValueError, match="1 image"):
        check_placeholders(ids, IMG, items[:1])  # the prompt holds two images' tokens
    with pytest.raises(ValueError, match=r"mm_inputs\[1\]"):
        check_placeholders(ids, IMG, items[:1] + items[:1])  # both at the first run
    with pytest.raises(ValueError, match=r"mm_inputs\[1\]"):
        check_placeholders(ids, IMG, [items[0], Item("b", 4, 9)])


def test_the_runner_encodes_an_image_its_rows_read_that_is_not_stored() -> None:
    """A part of a failed step run again has no encoder batch of its own: the images its rows
    read that the cache only expects are encoded with it, once."""
    import torch

    from batchgen_data.worker import mm_step

    class Tower:
        calls: list[int] = []

        def encode_images(self, pixels: torch.Tensor, grids: list) -> torch.Tensor:
            self.calls.append(pixels.shape[0])
            return torch.ones(pixels.shape[0], 8)

    cache, tower = EncoderCache(100), Tower()
    pending, stored = Item("p", 4, 0, torch.zeros(4, 3)), Item("s", 2, 0, torch.zeros(2, 3))
    cache.reserve("p")
    cache.put("s", torch.zeros(2, 8))
    mm_step.encode(tower, cache, [], [(0, pending, 0, 4), (4, stored, 0, 2), (6, pending, 0, 4)])
    assert tower.calls == [4] and cache.ready("p") and cache.encoded == 2
