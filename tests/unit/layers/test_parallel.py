"""How tensor parallelism splits a model (layers/parallel.py, models/tp_shards.py), without
processes: the KV-head rule, the padded vocabulary, the checks that name the bad value, and
that a rank > 0's entry point imports no connector."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from batchgen_data.layers import parallel


def test_kv_heads_split_or_replicated() -> None:
    assert [parallel.kv_heads_of_rank(8, 4, r) for r in range(4)] == [
        range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    # fewer KV heads than ranks: each head kept by size / kv ranks, the ones whose queries read it
    assert [parallel.kv_heads_of_rank(2, 4, r).start for r in range(4)] == [0, 0, 1, 1]
    assert [parallel.kv_heads_of_rank(1, 2, r).start for r in range(2)] == [0, 0]
    assert parallel.local_kv_heads(1, 2) == 1 and parallel.local_kv_heads(8, 2) == 4


def test_vocab_is_padded_to_the_ranks() -> None:
    assert parallel.padded_vocab(401, 2) == 402
    assert parallel.padded_vocab(151936, 8) == 151936


def _config(heads: int, kv: int, inter: int) -> SimpleNamespace:
    return SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv,
                           intermediate_size=inter)


@pytest.mark.parametrize("cfg, size, words", [
    (_config(4, 2, 128), 3, "tensor_parallel_size=3 does not divide the model's "
                            "num_attention_heads=4"),
    (_config(6, 3, 128), 2, "num_key_value_heads=3 is neither"),
    (_config(4, 4, 130), 4, "intermediate_size=130"),
])
def test_bad_sizes_are_named(cfg: SimpleNamespace, size: int, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parallel.check_shape(cfg, size)


def test_allowed_sizes_pass() -> None:
    parallel.check_shape(_config(4, 2, 128), 4)  # two KV heads, each on two ranks
    parallel.check_shape(_config(4, 1, 128), 2)
    parallel.check_shape(_config(4, 2, 130), 1)  # one rank: nothing is split


def test_single_rank_collectives_do_nothing() -> None:
    import torch

    x = torch.ones(3)
    assert parallel.SINGLE.all_reduce(x) is x
    assert parallel.SINGLE.gather_vocab(x, 3) is x


def test_rank_worker_imports_no_connector() -> None:
    code = ("import sys, batchgen_data.engine.rank_worker, batchgen_data.engine.setup; "
            "bad = [m for m in sys.modules if m.startswith(('batchgen_data.connectors', 'ray', "
            "'pyspark'))]; print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
