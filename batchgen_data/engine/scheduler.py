"""The scheduler: which suspended coroutines run in the next step, and with how many tokens.

It never asks "prefill or decode": every sequence simply has pending tokens (`num_tokens -
num_computed_tokens`). Each step fills a token budget in priority order — running sequences
first (so they finish and free memory), then preempted ones, then new ones — chunking long
prompts to fit. When KV blocks run out it preempts the running sequences that are cheapest to
bring back (fewest computed tokens) by holding them: their KV goes to the host tier when it fits,
otherwise it is dropped and recomputed (often from the prefix cache) on resume.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from batchgen_data.config import SchedulerConfig
from batchgen_data.engine.prompt_logprobs import cacheable_tokens
from batchgen_data.engine.sequence import Sequence, SequenceStatus
from batchgen_data.kvcache.block_pool import BlockPool
from batchgen_data.kvcache.host_tier import HostKVTier


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    # KV to copy to host before the step runs (the blocks are already released in the pool)
    swap_out: list[tuple[Sequence, list[int]]] = field(default_factory=list)
    # sequences whose host KV must be copied into their new blocks before the step runs
    swap_in: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, host: HostKVTier) -> None:
        self.config = config
        self.pool = pool
        self.host = host
        self.waiting: deque[Sequence] = deque()
        self.preempted: deque[Sequence] = deque()  # resumed automatically, before new work
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # admit new work only while this many blocks stay free, so decodes have room to grow
        self.watermark = max(1, pool.num_blocks // 100)

    # ---- queue management -------------------------------------------------------------
    def add(self, seq: Sequence, front: bool = False) -> None:
        (self.waiting.appendleft if front else self.waiting.append)(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.preempted or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of every queue and release its KV (used by abort/hold/export/finish)."""
        for q in (self.waiting, self.preempted):
            if seq in q:
                q.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self.release(seq)

    def release(self, seq: Sequence) -> None:
        if seq.block_ids:
            self.pool.free(seq.block_ids)
            seq.block_ids = []

    # ---- one step ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_pending_tokens, budget)
            while not self._can_grow(seq, n, keep_free=0):
                victim = self._pick_victim(self.running[i + 1:]) or seq
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                self._grow(seq, n)
                out.seqs.append(seq)
                out.num_new_tokens.append(n)
                budget -= n
                i += 1
        if out.preempted:
            return out  # memory is tight: admit nothing new this step
        budget = self._admit(self.preempted, out, budget)
        if not self.preempted:
            self._admit(self.waiting, out, budget)
        return out

    def _admit(self, queue: deque[Sequence], out: SchedulerOutput, budget: int) -> int:
        while queue and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = queue[0]
            if seq.host_kv is None and seq.num_computed_tokens == 0:
                self._match_prefix(seq)
            n = min(seq.num_pending_tokens, budget)
            if not self._can_grow(seq, n, keep_free=self.watermark):
                if seq.host_kv is None:
                    self.release(seq)  # give back prefix hits; matched again next step
                    seq.num_computed_tokens = 0
                    seq.block_hashes = []
                break
            queue.popleft()
            self._grow(seq, n)
            if seq.host_kv is not None:
                out.swap_in.append(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n
        return budget

    def _match_prefix(self, seq: Sequence) -> None:
        # the last token is always computed so that there are logits to sample from (and
        # prompt positions whose logprobs are still to record, see engine/prompt_logprobs.py)
        blocks, hashes = self.pool.match_prefix(seq.token_ids, cacheable_tokens(seq))
        seq.block_ids = blocks
        seq.block_hashes = hashes
        seq.num_computed_tokens = len(blocks) * self.pool.block_size
        if seq.num_output_tokens == 0:
            seq.num_cached_tokens = seq.num_computed_tokens

    def _blocks_needed(self, seq: Sequence, n: int) -> int:
        bs = self.pool.block_size
        total = -(-(seq.num_computed_tokens + n) // bs)
        return max(0, total - len(seq.block_ids))

    def _can_grow(self, seq: Sequence, n: int, keep_free: int) -> bool:
        return self._blocks_needed(seq, n) + keep_free <= self.pool.num_free

    def _grow(self, seq: Sequence, n: int) -> None:
        need = self._blocks_needed(seq, n)
        if need:
            seq.block_ids.extend(self.pool.allocate(need))

    @staticmethod
    def _pick_victim(candidates: list[Sequence]) -> Sequence | None:
        if not candidates:
            return None
        # cheapest to bring back: fewest computed tokens; ties go to the newest sequence
        return min(candidates, key=lambda s: (s.num_computed_tokens, -s.seq_id))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        mode = self.config.preemption_mode
        keep = mode != "recompute" and seq.num_computed_tokens > 0 and self.host.fits(
            seq.num_computed_tokens)
        if keep:
            out.swap_out.append((seq, list(seq.block_ids)))
        else:
            seq.num_computed_tokens = 0
        self.release(seq)
        seq.status = SequenceStatus.HELD
        self.preempted.append(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1

    def after_step(self, out: SchedulerOutput) -> None:
        """Publish newly completed full blocks of every scheduled sequence to the prefix cache."""
        bs = self.pool.block_size
        for seq in out.seqs:
            full = min(seq.num_computed_tokens, len(seq.token_ids)) // bs
            while len(seq.block_hashes) < full:
                j = len(seq.block_hashes)
                parent = seq.block_hashes[-1] if seq.block_hashes else None
                toks = tuple(seq.token_ids[j * bs:(j + 1) * bs])
                seq.block_hashes.append(self.pool.register(seq.block_ids[j], parent, toks))
