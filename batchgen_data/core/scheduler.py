"""The scheduler: which suspended coroutines run in the next step, and with how many tokens.

It never asks "prefill or decode": every sequence simply has pending tokens (`num_tokens -
num_computed_tokens`). Each step fills a token budget in priority order — running sequences
first (so they finish and free memory), then held ones, then new ones — chunking long prompts to
fit. When KV blocks run out it first asks `reclaim` for evictable blocks held outside the queues
(the engine's prefix pins), then preempts the running sequences that are cheapest to bring back
(fewest computed tokens): it holds them for memory, and `decide_held_kv` (core/kv/held_kv.py)
says whether their KV is kept in host memory or dropped and recomputed on resume. Which tier a
sequence's blocks come from is core/kv/room.py's; a running sequence short of blocks preempts
others of its own tier. "Held" is one state (`SequenceStatus.HELD`: no KV blocks, not
scheduled) with two reasons: held for memory by the scheduler (`Scheduler.held`, resumed before
new work) or by the user (`Engine.hold`, resumed by `Engine.resume`).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from operator import attrgetter

import numpy as np

from batchgen_data.config import SchedulerConfig
from batchgen_data.core.sequence import Sequence, SequenceStatus, cacheable_tokens
# what a schedule hands the step (re-exported: callers import them from here)
from batchgen_data.core.scheduler_output import SchedulerOutput, step_token_budget  # noqa: F401
from batchgen_data.core.kv import room
from batchgen_data.core.kv.block_pool import BlockPool
from batchgen_data.core.kv.held_kv import HeldKVStore, decide_held_kv
from batchgen_data.core.encoder_cache import EncoderCache
from batchgen_data.core import encoder_step

_COMPUTED = attrgetter("num_computed_tokens")
_TOKEN_IDS = attrgetter("token_ids")
_BLOCK_IDS = attrgetter("block_ids")
_BLOCK_HASHES = attrgetter("block_hashes")


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, host: HeldKVStore,
                 moe_routing: tuple[int, int] | None = None) -> None:
        self.config = config
        self.pool = pool
        self.held_kv = host
        # tokens per step; `moe_routing` is (num_experts, top_k) of an MoE model, else None
        self.token_budget = step_token_budget(config, moe_routing)
        self.waiting: deque[Sequence] = deque()
        self.held: deque[Sequence] = deque()  # held for memory: resumed before new work
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # admit new work only while this many blocks stay free, so decodes have room to grow
        self.watermark = max(1, pool.num_blocks // 100)
        # seam for evictable memory held outside the queues (the engine's prefix pins): called
        # with (blocks short, the sequence asking or None for a running one) before anything is
        # preempted or left waiting; returns the blocks it freed
        self.reclaim: Callable[[int, Sequence | None], int] | None = None
        # LoRA: at most this many adapters among the running sequences (the device slots,
        # worker/lora_manager.py); None: no limit
        self.max_loras: int | None = None
        # the request admitted to run alone (`Sequence.alone`): no other request runs with it
        self.alone: str | None = None
        self._alone_waiting: set[int] = set()  # sequences of such requests passed over once
        # a model that takes images: its encoder outputs by content hash, which a prompt's
        # images must be in before its prefill reaches them (core/encoder_step.py)
        self.encoder_cache: EncoderCache | None = None
        self.encoder_left = 0  # image rows the step's encoder batch may still take
        self.prefilling: list[Sequence] = []  # sequences holding their images' outputs

    # ---- queue management -------------------------------------------------------------
    def add(self, seq: Sequence, front: bool = False) -> None:
        (self.waiting.appendleft if front else self.waiting.append)(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.held or self.running)

    def remove(self, *seqs: Sequence) -> None:
        """Take `seqs` out of every queue and release their KV (abort/hold/export/finish).
        One pass over the running list for all of them; the queues, which a batch job fills
        with thousands of rows, are searched only for sequences that were not running."""
        if not seqs:
            return
        gone = {s.seq_id for s in seqs}
        running = len(self.running)
        self.running[:] = [s for s in self.running if s.seq_id not in gone]
        if running - len(self.running) < len(seqs):
            for seq in seqs:
                for q in (self.waiting, self.held):
                    if seq in q:
                        q.remove(seq)
        for seq in seqs:
            self.release(seq)
        if self._alone_waiting:
            self._alone_waiting.difference_update(s.seq_id for s in seqs)
        if self.alone is not None and not any(
                s.request_id == self.alone for q in (self.running, self.held) for s in q):
            self.alone = None  # its last sequence left: others may run again

    def release(self, seq: Sequence) -> None:
        if seq.block_ids:
            self.pool.free(room.live_blocks(seq.block_ids))
            seq.block_ids = []
        if seq.mm_held:
            encoder_step.let_go(self, seq)

    # ---- one step ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.encoder_left = self.config.encoder_budget
        budget = self._schedule_running(out)
        if out.held:
            return out  # memory is tight: admit nothing new this step
        budget = self._admit(self.held, out, budget)
        if not self.held:
            self._admit(self.waiting, out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput) -> int:
        """Schedule the running sequences in order, each with all its pending tokens while
        the budget lasts, growing (or preempting) those whose blocks are full; returns the
        budget left. When every pending token fits the budget (most steps) the sequences
        whose blocks already hold their new tokens are found with array arithmetic and only
        the others are visited, in order, as the loop would: the result is the same."""
        run, budget = self.running, self.token_budget
        m = len(run)
        computed = np.fromiter(map(_COMPUTED, run), np.int64, m)
        pending = np.fromiter(map(len, map(_TOKEN_IDS, run)), np.int64, m) - computed
        if int(pending.sum()) > budget:
            return self._schedule_running_loop(out, budget)
        room = np.fromiter(map(len, map(_BLOCK_IDS, run)), np.int64, m) * self.pool.block_size
        seqs, counts = list(run), pending.tolist()
        ends = computed + pending
        full = np.flatnonzero(ends > room)  # their blocks are full
        bs = self.pool.block_size
        need = -(-ends[full] // bs) - room[full] // bs
        if not self.pool.num_host_blocks and int(need.sum()) <= self.pool.num_free:
            # every one grows in the device tier without preempting: one allocation, handed
            # out in order, is what growing them one by one would give each
            blocks = self.pool.allocate(int(need.sum()))
            at = 0
            for j, k in zip(full.tolist(), need.tolist()):
                seqs[j].block_ids.extend(blocks[at:at + k])
                at += k
        else:
            for j in full.tolist():
                if seqs[j].status == SequenceStatus.RUNNING:  # not preempted by an earlier one
                    self._grow_running(seqs[j], counts[j], out)
        if out.held:
            kept = [(s, n) for s, n in zip(seqs, counts) if s.status == SequenceStatus.RUNNING]
            seqs, counts = [s for s, _ in kept], [n for _, n in kept]
        else:
            out.arrays = (computed, ends)
        out.seqs, out.num_new_tokens = seqs, counts
        return budget - sum(counts)

    def running_fits(self) -> bool:
        """Whether the free device blocks hold every running sequence's pending tokens, so
        that the next `schedule()` preempts nobody (engine/stepper.py asks before a look-ahead)."""
        m, bs = len(self.running), self.pool.block_size
        tokens = np.fromiter(map(len, map(_TOKEN_IDS, self.running)), np.int64, m)
        blocks = np.fromiter(map(len, map(_BLOCK_IDS, self.running)), np.int64, m)
        need = int(np.maximum(0, -(-tokens // bs) - blocks).sum())
        return not self.pool.num_host_blocks and need <= self.pool.num_free

    def _schedule_running_loop(self, out: SchedulerOutput, budget: int) -> int:
        """`_schedule_running` one sequence at a time, for a step the budget cuts short."""
        bs = self.pool.block_size
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            if seq.num_computed_tokens + n > len(seq.block_ids) * bs \
                    and not self._grow_running(seq, n, out):
                continue  # it was preempted: running[i] is the next one now
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n
            i += 1
        return budget

    def _grow_running(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Give running `seq` the blocks for `n` more tokens, preempting the running sequences
        after it in its tier, cheapest first, while short, and at last itself (then False)."""
        while not self._make_room(seq, n, keep_free=0, asking=None):
            tier = self._on_host(seq)  # preempting the other tier frees nothing here
            later = self.running[self.running.index(seq) + 1:]
            same = [s for s in later if self._on_host(s) == tier]
            victim = self._pick_victim(same) or seq
            self._preempt(victim, out)
            if victim is seq:
                return False
        self.grow(seq, n)
        return True

    def _admit(self, queue: deque[Sequence], out: SchedulerOutput, budget: int) -> int:
        adapters = None if self.max_loras is None else \
            {s.lora.lora_int_id for s in self.running if s.lora is not None}
        # their adapter has no slot now, or they run alone and others run: they keep their place
        passed: list[Sequence] = []
        while queue and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = queue[0]
            if self.alone is not None and seq.request_id != self.alone:
                break  # nothing joins a request that runs alone
            if seq.alone and not self._may_join(seq):
                if seq.seq_id in self._alone_waiting:
                    break  # passed over once: now the running ones drain, and it starts
                self._alone_waiting.add(seq.seq_id)
                passed.append(queue.popleft())  # the others queued now still start together
                continue
            if adapters is not None and seq.lora is not None \
                    and seq.lora.lora_int_id not in adapters:
                if len(adapters) >= self.max_loras:  # type: ignore[operator]
                    passed.append(queue.popleft())
                    continue
                adapters.add(seq.lora.lora_int_id)
            if seq.held_kv is None and seq.num_computed_tokens == 0:
                self._match_prefix(seq)
            n = min(seq.num_pending_tokens, budget)
            images = None
            if seq.mm is not None and self.encoder_cache is not None and not seq.mm_held:
                images = encoder_step.to_encode(self, seq, out)
                if images is None:  # its images wait for a later step's encoder batch
                    if seq.held_kv is None:
                        self.release(seq)
                        seq.num_computed_tokens = 0
                        seq.block_hashes = []
                    break
            fits = self._make_room(seq, n, keep_free=self.watermark, asking=seq)
            if not fits and seq.held_kv is None:
                self.release(seq)  # give back prefix hits; matched again next step
                seq.num_computed_tokens = 0
                seq.block_hashes = []
                if self.pool.num_host_blocks:  # its prefix's tier is full: start in the other
                    if seq.num_output_tokens == 0:
                        seq.num_cached_tokens = 0
                    n = min(seq.num_pending_tokens, budget)
                    fits = self._can_grow(seq, n, keep_free=self.watermark)
            if not fits:
                break
            queue.popleft()
            self.grow(seq, n, keep_free=self.watermark)
            if seq.held_kv is not None:
                out.swap_in.append(seq)
            if images is not None:
                encoder_step.hold(self, seq, images, out)
            seq.status = SequenceStatus.RUNNING
            if seq.alone:
                self.alone = seq.request_id
                self._alone_waiting.discard(seq.seq_id)
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n
        queue.extendleft(reversed(passed))
        return budget

    def _may_join(self, seq: Sequence) -> bool:
        """Whether `seq`, of a request that runs alone (one the connectors suspect of killing
        an engine: docs/row-errors.md), may start now: only among its own request's
        sequences."""
        return all(s.request_id == seq.request_id for s in self.running)

    def _match_prefix(self, seq: Sequence) -> None:
        # the last token is always computed so that there are logits to sample from (and
        # prompt positions whose logprobs are still to record, see sample/prompt_logprobs.py)
        ids = seq.token_ids if seq.mm is None else seq.mm.keys(seq.token_ids)  # images keyed
        blocks, hashes = self.pool.match_prefix(ids, cacheable_tokens(seq),
                                                root=seq.cache_root)
        seq.block_ids = blocks
        seq.block_hashes = hashes
        seq.num_computed_tokens = len(blocks) * self.pool.block_size
        if seq.num_output_tokens == 0:
            seq.num_cached_tokens = seq.num_computed_tokens

    def _on_host(self, seq: Sequence) -> bool:
        return room.on_host(self.pool, seq)

    def _can_grow(self, seq: Sequence, n: int, keep_free: int) -> bool:
        return room.can_grow(self.pool, seq, n, keep_free)

    def _make_room(self, seq: Sequence, n: int, keep_free: int, asking: Sequence | None) -> bool:
        """`_can_grow`, after asking `reclaim` for the device blocks missing, if any."""
        if self._can_grow(seq, n, keep_free):
            return True
        if self._on_host(seq):
            return False  # `reclaim` frees device blocks only
        short = room.blocks_needed(self.pool, seq, n) + keep_free - self.pool.num_free
        if short > 0 and self.reclaim is not None:
            self.reclaim(short, asking)
        return self._can_grow(seq, n, keep_free)

    def grow(self, seq: Sequence, n: int, keep_free: int = 0) -> None:
        """Give `seq` the blocks for `n` tokens beyond its computed ones (they must be free;
        core/kv/room.py)."""
        room.grow(self.pool, seq, n, keep_free)

    @staticmethod
    def _pick_victim(candidates: list[Sequence]) -> Sequence | None:
        if not candidates:
            return None
        # cheapest to bring back: fewest computed tokens; ties go to the newest sequence
        return min(candidates, key=lambda s: (s.num_computed_tokens, -s.seq_id))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        if decide_held_kv(seq, self.held_kv, keep=self.config.preemption_mode != "recompute"):
            out.swap_out.append((seq, list(seq.block_ids)))
        self.release(seq)
        seq.status = SequenceStatus.HELD
        self.held.append(seq)
        out.held.append(seq)
        self.num_preemptions += 1

    def after_step(self, out: SchedulerOutput,
                   flat: tuple[list[Sequence], np.ndarray, np.ndarray] | None = None) -> None:
        """Publish newly completed full blocks of every scheduled sequence to the prefix cache.
        `flat`: the step's sequences in any order with their computed tokens and token counts
        now, as the runner knew them (`ModelInput.flat`), so they need not be read again."""
        bs = self.pool.block_size
        if self.prefilling:  # images whose prompts are computed past them: let go
            encoder_step.prefilled(self)
        if flat is None:
            seqs = out.seqs
            m = len(seqs)
            computed = np.fromiter(map(_COMPUTED, seqs), np.int64, m)
            tokens = np.fromiter(map(len, map(_TOKEN_IDS, seqs)), np.int64, m)
        else:
            seqs, computed, tokens = flat
            m = len(seqs)
        full = np.minimum(computed, tokens) // bs
        hashed = np.fromiter(map(len, map(_BLOCK_HASHES, seqs)), np.int64, m)
        for i in np.flatnonzero(full > hashed).tolist():  # the sequences that filled a block
            seq, blocks = seqs[i], int(full[i])
            # a prompt's images are keyed by their content hash, not their placeholder ids
            ids = seq.token_ids if seq.mm is None else seq.mm.keys(seq.token_ids)
            while len(seq.block_hashes) < blocks:
                j = len(seq.block_hashes)
                parent = seq.block_hashes[-1] if seq.block_hashes else seq.cache_root
                toks = tuple(ids[j * bs:(j + 1) * bs])
                b = seq.block_ids[j]
                seq.block_hashes.append(self.pool.register(b, parent, toks) if b >= 0
                                        else self.pool.chain_hash(parent, toks))
        if self.pool.window:  # a windowed model: free the blocks every window has passed
            for i, seq in enumerate(seqs):
                room.trim(self.pool, seq, int(computed[i]))

    # ---- reports ----------------------------------------------------------------------
    def admits(self, seq: Sequence, n: int) -> bool:
        """Whether the blocks free now let queued `seq` start with `n` tokens under the
        admission watermark: the block test `schedule` applies before it asks `reclaim`."""
        return self._can_grow(seq, n, keep_free=self.watermark)
