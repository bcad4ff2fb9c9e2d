"""Prefix keys: the leading KV blocks of a prompt, named the same way in every process.

An engine's prefix cache chains each full block's hash from its parent's (core/kv/block_pool.py),
starting from `None`, whose `hash` is an address before Python 3.12, so those hashes differ
between processes and cannot be compared across engines. A *prefix key* is the same chain
started from a fixed integer: the hash of a tuple of integers depends on their values alone (no
`PYTHONHASHSEED`, no address), so engine A's cached block and a row tokenized in engine B's
process agree on it wherever the engines run one Python build, as a job's do. It costs one tuple
hash a block (a cryptographic digest cost ten times more, on every block the engine caches);
a collision only misplaces a row.

Keys are kept only for the first `MAX_BLOCKS` blocks and published only at the geometric depths
`DEPTHS` (1, 2, 4, ... blocks), so a summary costs a handful of keys per cached prefix while a
longest match is still resolved to within a factor of two of its length. A key at depth d names
the whole prefix of d blocks (each key chains in its parent), so finding the row's depth-d key
in an engine's summary means the engine held those d blocks when it reported.
"""
from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass

from batchgen_data.placement.migration import EngineId

DEPTHS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
MAX_BLOCKS = DEPTHS[-1]
_ROOT = 0x5EED_B10C_0F_CAC4E  # the parent of a first block (the base model's chain)


def block_key(parent: int | None, tokens: Sequence[int]) -> int:
    """The key of one full block: a hash of its parent's key and its token ids."""
    return hash((_ROOT if parent is None else parent, tuple(tokens)))


def chain_keys(token_ids: Sequence[int], block_size: int,
               max_blocks: int = MAX_BLOCKS) -> list[int]:
    """The keys of the leading full blocks of `token_ids`, one per block, at most `max_blocks`."""
    if block_size <= 0:
        raise ValueError(f"block_size={block_size!r}: must be > 0")
    keys: list[int] = []
    parent: int | None = None
    for i in range(min(len(token_ids) // block_size, max_blocks)):
        parent = block_key(parent, token_ids[i * block_size:(i + 1) * block_size])
        keys.append(parent)
    return keys


def prefix_keys(token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """A row's keys at the published depths its prompt reaches (`DEPTHS`), shallowest first."""
    keys = chain_keys(token_ids, block_size)
    return tuple(keys[d - 1] for d in DEPTHS if d <= len(keys))


def match_depth(row_keys: Sequence[int], held: Container[int]) -> int:
    """How many of the row's published depths an engine holding `held` covers: the index + 1
    of its deepest key found there (0: none). Deeper is a longer cached prefix."""
    for i in range(len(row_keys) - 1, -1, -1):
        if row_keys[i] in held:
            return i + 1
    return 0


def matched_blocks(depth_index: int) -> int:
    """Blocks a `match_depth` result stands for (0 for 0)."""
    return DEPTHS[depth_index - 1] if depth_index > 0 else 0


@dataclass(frozen=True, slots=True)
class PrefixSummary:
    """What one engine's prefix cache holds, as a placement policy reads it
    (`Engine.prefix_summary`): the keys of its cached blocks at the published depths.
    `version` changes whenever the set may have, so a reporter resends it only then."""

    engine_id: EngineId
    version: int
    block_size: int
    keys: frozenset[int]

    def depth_of(self, row_keys: Sequence[int]) -> int:
        return match_depth(row_keys, self.keys)
