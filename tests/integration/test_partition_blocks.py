"""A group of 4 one-device engines joins into 2 TP engines 2 wide (engine/group/group.py,
`width=2`; gloo on the CPU, four processes, one thread each): ranks 0-1 and 2-3 each become
one TP engine, rank 0 stepping its own while rank 2 leads the other on rank 0's messages. The
group steps joined, takes new requests on both TP engines, splits back into 4 engines, and
finishes: every request finished exactly once, every greedy token equal to HF `generate`.
A rank killed while the group runs as two TP engines fails it with EngineDeadError, fast; the
front door (`LLM(..., repartition_width=2)`) gives the same tokens.

Four processes each load a whole (tiny) engine: ~5-10 s a test on a 2-core box.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchgen_data.engine.group.group import EngineGroup, PartitionPolicy
from batchgen_data.outputs import RequestOutput

from tests.integration.test_partition import (KW, LATE, ROWS, Outputs, _model, _want,
                                              dies_fast, greedy)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_four_engines_join_into_two_tp_engines_and_split_back(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    path = _model(tmp_path, "llama", num_key_value_heads=2)
    last = ([9, 8, 7, 6, 5], 9)  # submitted just before the split: still queued for rank 2
    want = _want(path, ROWS + LATE + [last])
    # joins once 4 sequences are left (of 6), nothing queued; never splits on its own
    policy = PartitionPolicy(join_below_seqs=4, wide_step_ratio=0.5, switch_s=0.0)
    group = EngineGroup.from_kwargs(str(path), size=4, width=2, policy=policy, **KW)
    outs = Outputs()
    collect = outs.collect

    try:
        ids = [group.submit(p, greedy(n)) for p, n in ROWS]
        assert sorted(group.where.values()) == [0, 0, 1, 1, 2, 3]  # all four engines
        while group.width == 1:
            collect(group.step())
            assert group.has_unfinished()
        join = group.switches[0]
        assert (join.direction, join.width, join.engines) == ("join", 2, 2)
        assert 2 <= join.seqs <= 4 and join.kv_bytes > 0
        assert join.tp_sizes == [2, 2]  # each TP engine's model, as its holder reports it
        assert group.heads() == [0, 2]
        assert sorted(set(group.where.values())) == [0, 2]  # both TP engines hold requests
        model = group.engine.runner.model
        assert model.shape.tp.size == 2 and model.shape.num_kv_heads == 1
        assert model.layers[0].self_attn.qkv_proj.out_features == (2 + 1 + 1) * 16
        for _ in range(2):
            collect(group.step())
        ids += [group.submit(p, greedy(n)) for p, n in LATE]  # new work, joined
        assert {group.where[i] for i in ids[-2:]} <= {0, 2}
        for _ in range(2):
            collect(group.step())
        live = len(group.where)
        ids.append(group.submit(*last[:1], greedy(last[1])))
        if group.where[ids[-1]] == 0:  # (rank 0's are submitted at once: queue one for 2)
            ids.append(group.submit(list(last[0]), greedy(last[1])))
            want.append(want[-1])
        assert group.where[ids[-1]] == 2 and group._work[2]["submit"]
        split = group.split()
        assert (split.direction, split.width, split.engines) == ("split", 2, 2)
        assert split.seqs == live and group.width == 1  # the queued ones: placed after it
        assert set(ids) - set(outs) == set(group.where)
        assert len(set(group.where.values())) == min(live, 4)  # spread over the four again
        assert group.engine.runner.model.layers[0].self_attn.qkv_proj.out_features == \
            (4 + 2 + 2) * 16  # whole weights again (all-gathered within the block)
        while group.has_unfinished():  # the policy may join again for the tail
            collect(group.step())
        assert [s.direction for s in group.switches][:2] == ["join", "split"]
    finally:
        group.close()
    assert sorted(outs) == sorted(ids)  # every request finished, once
    assert [list(outs[i].outputs[0].token_ids) for i in ids] == want
    assert all(outs[i].outputs[0].finish_reason == "length" for i in ids)


def test_the_policy_splits_blocks_when_work_queues_behind_a_tp_engine(tmp_path: Path) -> None:
    """Joined into 2 TP=2 engines (each running at most 2 sequences), 6 new requests queue up
    behind them: the policy splits (any TP engine's load may call for it), then the job
    finishes with HF `generate`'s greedy tokens."""
    torch.set_num_threads(1)
    path = _model(tmp_path, "llama", num_key_value_heads=2)
    more = [(list(range(300 + 7 * i, 305 + 7 * i)), 5 + i) for i in range(6)]
    want = _want(path, ROWS + more)
    policy = PartitionPolicy(join_below_seqs=4, wide_step_ratio=0.5, switch_s=0.0,
                             split_above_seqs=1)
    group = EngineGroup.from_kwargs(str(path), size=4, width=2, policy=policy, max_num_seqs=2,
                                    **KW)
    outs: dict[str, RequestOutput] = {}
    try:
        ids = [group.submit(p, greedy(n)) for p, n in ROWS]
        while group.width == 1:
            outs.update((o.request_id, o) for o in group.step())
        ids += [group.submit(p, greedy(n)) for p, n in more]
        for _ in range(3):
            if group.width == 1:
                break
            outs.update((o.request_id, o) for o in group.step())
        assert [s.direction for s in group.switches] == ["join", "split"]
        assert group.switches[1].seqs + sum(1 for i in ids if i in outs) == len(ids)
        while group.has_unfinished():
            outs.update((o.request_id, o) for o in group.step())
    finally:
        group.close()
    assert [list(outs[i].outputs[0].token_ids) for i in ids] == want


@pytest.mark.parametrize("victim", [1, 2, 3], ids=["rank0s-block", "leader", "leaders-block"])
def test_a_rank_killed_while_joined_in_blocks_fails_the_group_fast(
        victim: int, tmp_path: Path) -> None:
    """Rank 1 serves rank 0's own TP engine; rank 2 leads the other; rank 3 serves rank 2's
    (only rank 0 holds the processes: its bounded wait on the leaders reports that block)."""
    torch.set_num_threads(1)
    path = _model(tmp_path, "llama", num_key_value_heads=2)
    group = EngineGroup.from_kwargs(str(path), size=4, width=2, **{
        **KW, "collective_timeout_s": 10.0})
    try:
        for p, n in ROWS:
            group.submit(p, greedy(n))
        group.step()
        late = group.submit(*LATE[0][:1], greedy(LATE[0][1]))  # queued for rank 1's step
        assert group.where[late] != 0
        group.repartition()  # ... so it goes to a TP engine as a new request
        assert sorted(set(group.where.values())) == [0, 2] and group.where[late] in (0, 2)
        group.step()
        group.ranks.procs[victim - 1].kill()

        def step_until_seen() -> None:  # (the victim's own rows may all be done)
            for _ in range(40):
                group.step()

        # (rank 3's leader may end first, its collectives failed: then rank 2 is named)
        dies_fast(group, step_until_seen, f"rank {victim if victim < 3 else '[23]'} exited",
                  30.0)
    finally:
        group.close()


def test_llm_with_four_engines_joining_two_wide(tmp_path: Path) -> None:
    """The front door: `LLM(data_parallel_size=4, repartition=..., repartition_width=2)`."""
    from batchgen_data import LLM

    torch.set_num_threads(1)
    path = _model(tmp_path, "llama", num_key_value_heads=2)
    want = _want(path, ROWS)
    llm = LLM(str(path), data_parallel_size=4, repartition_width=2, **KW,
              repartition=PartitionPolicy(join_below_seqs=4, wide_step_ratio=0.5, switch_s=0.0))
    try:
        got = llm.generate([{"prompt_token_ids": p} for p, _ in ROWS],
                           [greedy(n) for _, n in ROWS], use_tqdm=False)
        join = llm.engine.switches[0]
        assert (join.direction, join.width, join.engines, join.tp_sizes) == \
            ("join", 2, 2, [2, 2])
    finally:
        llm.close()
    assert [list(o.outputs[0].token_ids) for o in got] == want
