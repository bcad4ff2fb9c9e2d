"""Prefix keys (placement/prefix.py) and the block pool's summary of them (core/kv/block_pool.py):
the same in every process, published at the geometric depths only, gone with the cached block."""
from __future__ import annotations

import os
import random
import subprocess
import sys

from batchgen_data.core.kv.block_pool import BlockPool
from batchgen_data.placement import DEPTHS, chain_keys, match_depth, prefix_keys

BS = 4


def register_prompt(pool: BlockPool, tokens: list[int], root: int | None = None) -> list[int]:
    """Register the prompt's full blocks as the scheduler does (a chain of parents)."""
    n = len(tokens) // BS
    blocks = pool.allocate(n)
    parent = root
    for i in range(n):
        parent = pool.register(blocks[i], parent, tuple(tokens[i * BS:(i + 1) * BS]))
    return blocks


def test_keys_name_the_whole_prefix() -> None:
    rng = random.Random(0)
    a = [rng.randrange(1000) for _ in range(40)]
    b = a[:20] + [7] * 20  # shares five blocks
    ka, kb = chain_keys(a, BS), chain_keys(b, BS)
    assert len(ka) == 10 and ka[:5] == kb[:5] and all(x != y for x, y in zip(ka[5:], kb[5:]))
    c = [a[0] + 1] + a[1:]  # one token differs in the first block: every key differs
    assert not set(chain_keys(c, BS)) & set(ka)
    # published at depths 1, 2, 4, 8 of the 10 blocks
    assert prefix_keys(a, BS) == tuple(ka[d - 1] for d in (1, 2, 4, 8))
    assert prefix_keys(a[:BS - 1], BS) == ()


def test_keys_are_the_same_in_another_process() -> None:
    # the pool's own chain hash is Python's hash, whose hash(None) differs between processes
    # in 3.11; prefix keys must not: compute them under another hash seed and compare
    tokens = list(range(3, 3 + 70))
    code = ("from batchgen_data.placement import chain_keys\n"
            f"print(chain_keys({tokens!r}, {BS}))\n")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                         capture_output=True, text=True).stdout
    assert eval(out) == chain_keys(tokens, BS)


def test_match_depth_takes_the_deepest_key_held() -> None:
    keys = (11, 22, 33, 44)
    assert match_depth(keys, {11, 22, 33}) == 3
    assert match_depth(keys, {44}) == 4
    assert match_depth(keys, set()) == 0
    assert match_depth((), {1}) == 0


def test_pool_publishes_its_cached_prefixes_at_the_depths() -> None:
    pool = BlockPool(64, BS)
    rng = random.Random(1)
    doc = [rng.randrange(1000) for _ in range(9 * BS + 2)]  # nine full blocks
    v0 = pool.prefix_version
    blocks = register_prompt(pool, doc)
    assert pool.prefix_version > v0
    keys = chain_keys(doc, BS)
    assert pool.prefix_keys() == {keys[d - 1] for d in DEPTHS if d <= 9}  # depths 1, 2, 4, 8
    # an adapter's chain (a root) publishes nothing
    other = BlockPool(64, BS)
    register_prompt(other, doc, root=hash(("lora", 1)))
    assert other.prefix_keys() == frozenset()
    # freed blocks stay cached and published until recycled for new tokens
    pool.free(blocks)
    assert pool.prefix_keys() == {keys[d - 1] for d in DEPTHS if d <= 9}
    v1 = pool.prefix_version
    pool.allocate(64)  # recycles every block, the cached ones included
    assert pool.prefix_keys() == frozenset() and pool.prefix_version > v1


def test_pool_stops_keying_past_the_deepest_depth() -> None:
    pool = BlockPool(200, BS)
    doc = list(range(DEPTHS[-1] * BS + 10 * BS))
    register_prompt(pool, doc)
    assert len(pool._prefix_of) == DEPTHS[-1]  # the blocks beyond carry no key
    assert pool.prefix_keys() == set(prefix_keys(doc, BS))
    pool.reset_prefix_cache()
    assert pool.prefix_keys() == frozenset()
