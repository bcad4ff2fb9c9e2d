"""Vectorised sampling: logit edits, penalties, min_tokens, greedy, temperature, top-k, top-p,
min-p, logprobs.

The order follows vLLM v1: allowed_token_ids, bad_words, logit_bias and min_tokens edit the
logits first, then penalties, then temperature and truncation. Logprobs are those of the raw
model distribution, before any of that (vLLM's default `logprobs_mode="raw_logprobs"`), so a
bias or a mask changes which token is drawn, not the logprobs reported for it.

No per-sequence Python loop touches the logits. Random sampling uses the exponential-race trick
(argmax of log p - log E, E ~ Exp(1)), with E drawn from a counter-based hash of
(sequence seed, output index, token id). That makes a seeded sequence's tokens independent of
whatever else shares its batch, of the batch size, and of the engine it runs on — which is what
lets a coroutine be exported mid-generation and continue elsewhere with identical tokens. The
draw itself (`token_draw.py`) races only over the tokens that could win (the top-k candidates,
or a band below each row's best logit), so no step holds a [N, vocab] integer tensor or sorts
the whole vocabulary. On CUDA the per-row work on those candidates is one Triton kernel
(`kernels/sampling.py`), chosen once per device. Logprobs are computed for the rows that ask.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from batchgen_data.sample.bad_words import BadWords
from batchgen_data.sample.sampling_batch import SamplingBatch
from batchgen_data.core.sequence import Sequence
from batchgen_data.sample.draw.draw_hash import hash_uniform_at
from batchgen_data.sample.draw.rows import Rows
from batchgen_data.sample.draw.token_draw import (
    RaceFn,
    race_over_candidates,
    threshold_race,
    top_k_race,
)
from batchgen_data.logprobs import RawLogprobs
from batchgen_data.sampling_params import SamplingParams
from batchgen_data.sample.structured.logits import StructuredLogits


def kernel_race(vals: torch.Tensor, ids: torch.Tensor, rows: Rows, total: torch.Tensor | None,
                ranked: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`race_over_candidates` as the Triton kernel (kernels/sampling.py)."""
    from batchgen_data.kernels.sampling import race_candidates
    return race_candidates(vals, ids, rows.temperature, rows.top_k, rows.top_p, rows.min_p,
                           rows.seeds, rows.steps, total, ranked)


def hash_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, vocab] float32 uniforms in (0, 1) from splitmix64 of (seed, step, token)."""
    return hash_uniform_at(seeds, steps, torch.arange(vocab, device=seeds.device).unsqueeze(0))


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[RawLogprobs | None]  # per row that asked: sampled id first, then the top-k


@dataclass
class PendingSample:
    """A step's draws as the device holds them, before anything reads them on the host
    (`Sampler.launch`; `Sampler.finish` turns them into a `SamplerOutput`). Between the two an
    overlapped engine starts the next step, which takes its tokens from `chosen` on the device
    (engine/stepper.py): nothing in a launch waits for the device except the sampling's own
    host reads (a top-p band's widening)."""

    chosen: torch.Tensor  # [N] int64, on the logits' device
    # the logprob rows: (rows [R], the chosen ids' logprobs [R] and vocabulary ranks [R], top
    # values and ids [R, k] or None), and what each row asked for; None when no row asks
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None,
                    torch.Tensor | None] | None
    want: list[int | None]
    host: tuple[torch.Tensor, ...] | None = None  # `to_host`'s copies

    def to_host(self) -> None:
        """Start copying what `finish` reads to host memory: asynchronously from a CUDA device
        (pinned memory; valid once the device has passed this point, which an event recorded
        after the call tells), a no-op for host tensors."""
        parts = [self.chosen, *(t for t in self.logprobs or () if t is not None)]
        self.host = tuple(t.to("cpu", non_blocking=True) for t in parts)


class Sampler:
    def __init__(self, stop_ids_for_min_tokens: set[int], tokenizer: Any = None) -> None:
        self.eos_ids = sorted(stop_ids_for_min_tokens)
        self.bad_words = BadWords(tokenizer)
        self.structured = StructuredLogits(tokenizer, self.eos_ids)
        self._races: dict[torch.device, RaceFn] = {}

    def _race(self, device: torch.device) -> RaceFn:
        """The per-row candidate work for a device, chosen once: the Triton kernel on CUDA,
        the torch path elsewhere."""
        race = self._races.get(device)
        if race is None:
            race = race_over_candidates
            if device.type == "cuda":
                from batchgen_data.kernels import triton_available
                if triton_available():
                    race = kernel_race
            self._races[device] = race
        return race

    def check(self, params: SamplingParams, vocab_size: int) -> None:
        """The request-time checks that need the model: token ids in the vocabulary, bad words
        that tokenise (ValueError naming the field)."""
        params.check_vocab(vocab_size)
        if params.bad_words:
            self.bad_words.check(params.bad_words, vocab_size)
        self.structured.check(params, vocab_size)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        # logits [N, V] float32, row i belongs to seqs[i]
        return self.sample(logits, self.batch(seqs, logits.shape[1], logits.device), seqs)

    def batch(self, seqs: list[Sequence], vocab: int, device: torch.device
              ) -> SamplingBatch | None:
        """The host half of a sampler call: what it reads of the sequences (lengths, histories,
        bans), for `sample` to use once the logits exist (engine/stepper.py builds it before the
        step's tokens of the step before are known)."""
        return SamplingBatch.build(seqs, vocab, self.eos_ids, device, self.bad_words)

    def sample(self, logits: torch.Tensor, b: SamplingBatch | None, seqs: list[Sequence]
               ) -> SamplerOutput:
        """Tokens of `seqs` from `logits` and their `batch`; reads no sequence state but the
        parameters (and structured outputs' grammar state)."""
        return self.finish(self.launch(logits, b, seqs))

    def launch(self, logits: torch.Tensor, b: SamplingBatch | None, seqs: list[Sequence]
               ) -> PendingSample:
        """`sample`'s device work: the draws and the logprobs asked for, left on the device."""
        if b is None:  # every row greedy, nothing to edit or report
            return PendingSample(logits.argmax(-1), None, [None] * len(seqs))
        want_lp = b.want_logprobs
        raw_logprobs = self._raw_logprobs(logits, want_lp)

        # edits go to a copy (the caller's logits stay raw); most steps edit nothing
        if (b.constrained or b.allowed is not None or b.bias is not None or b.ban.shape[1]
                or b.output_ids is not None):
            logits = logits.clone()
            self._edit(logits, b)
            if b.ban.shape[1]:
                logits[b.ban[0], b.ban[1]] = float("-inf")
            self.structured.apply(logits, seqs)  # grammar masks of structured_outputs rows
            self._penalties(logits, b)

        if b.all_greedy:
            chosen = logits.argmax(-1)
        else:
            chosen = self._draw(logits, b, seqs)
            if b.any_greedy:
                chosen = torch.where(b.greedy, logits.argmax(-1), chosen)
        return PendingSample(chosen, self._logprob_rows(raw_logprobs, chosen, want_lp), want_lp)

    def finish(self, p: PendingSample) -> SamplerOutput:
        """The host's read of a launch: after `p.to_host()` and the device passing it, or at
        once (a read of device tensors then waits for the device)."""
        chosen, *rest = p.host if p.host is not None else \
            (p.chosen, *(t for t in p.logprobs or () if t is not None))
        return SamplerOutput(chosen.tolist(), self._logprobs(p, rest))

    def _draw(self, logits: torch.Tensor, b: SamplingBatch, seqs: list[Sequence]
              ) -> torch.Tensor:
        """Sampled ids [N] (rows that are greedy get a value that the caller discards)."""
        vocab = logits.shape[1]
        ps = [s.params for s in seqs]
        sampled = [not p.greedy for p in ps]
        k_rows = [i for i, p in enumerate(ps) if sampled[i] and 0 < p.top_k < vocab]
        rows = Rows(b.seed, b.step, b.temperature, b.top_k,
                    b.top_p if any(s and p.top_p < 1 for s, p in zip(sampled, ps)) else None,
                    b.min_p if b.use_min_p else None)
        race = self._race(logits.device)
        drawn = None
        if len(k_rows) < sum(sampled):  # rows without top_k: the band and the floor
            active = ~b.greedy & (b.top_k >= vocab).squeeze(1)
            drawn = threshold_race(logits, rows, active, race,
                                   flat=race is race_over_candidates)
        if k_rows:
            k = max(ps[i].top_k for i in k_rows)
            if len(k_rows) == len(ps):
                return top_k_race(logits, rows, k, race)
            idx = torch.tensor(k_rows, device=logits.device)
            tok = top_k_race(logits[idx], rows.take(idx), k, race)
            drawn = (torch.zeros_like(b.seed) if drawn is None else drawn).index_copy(0, idx, tok)
        assert drawn is not None
        return drawn

    @staticmethod
    def _raw_logprobs(logits: torch.Tensor, want: list[int | None]
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows ``[R]``, their log-softmax ``[R, V]``) for the rows that ask for logprobs;
        None when none does."""
        rows = [i for i, w in enumerate(want) if w is not None]
        if not rows:
            return None
        if len(rows) == len(want):
            return torch.arange(len(want), device=logits.device), torch.log_softmax(logits, -1)
        idx = torch.tensor(rows, device=logits.device)
        return idx, torch.log_softmax(logits[idx], -1)

    @staticmethod
    def _edit(logits: torch.Tensor, b: SamplingBatch) -> None:
        """allowed_token_ids and logit_bias, in place (bad_words are in `b.ban`)."""
        if b.allowed is not None:
            # keep the allowed logits, blank the restricted rows, put them back: one pass over
            # the restricted rows only, no [N, V] mask
            kept = logits[b.allowed[0], b.allowed[1]]  # [A]
            logits.index_fill_(0, b.allowed_rows, float("-inf"))
            logits[b.allowed[0], b.allowed[1]] = kept
        if b.bias is not None:
            logits.index_put_((b.bias_at[0], b.bias_at[1]), b.bias, accumulate=True)

    @staticmethod
    def _penalties(logits: torch.Tensor, b: SamplingBatch) -> None:
        """Repetition, frequency and presence penalties, in place, touching only the tokens a
        row has seen: [N, L] work for L prompt + output ids, no [N, V] count or mask."""
        if b.output_ids is None:
            return
        vocab = logits.shape[1]
        ids = b.output_ids if b.prompt_ids is None else torch.cat([b.output_ids, b.prompt_ids], 1)
        tok = ids.sort(-1).values  # [N, L] padding (= vocab) last
        # padding re-writes the row's smallest id with the very value computed for it; a row
        # with no ids at all writes column 0 back unchanged
        tok = torch.where(tok < vocab, tok, tok[:, :1])
        empty = tok >= vocab
        tok = tok.masked_fill(empty, 0)
        val = logits.gather(1, tok)  # [N, L]
        new = val
        if b.prompt_ids is not None:
            rep = b.repetition
            new = torch.where(val > 0, val / rep, val * rep)
        if b.use_freq_presence:
            out = b.output_ids.sort(-1).values  # [N, Lo]
            counts = (torch.searchsorted(out, tok, right=True)
                      - torch.searchsorted(out, tok)).float()  # output occurrences of each id
            new = new - (b.frequency * counts + b.presence * (counts > 0).float())
        logits.scatter_(1, tok, torch.where(empty, val, new))

    @staticmethod
    def _logprob_rows(raw: tuple[torch.Tensor, torch.Tensor] | None, chosen: torch.Tensor,
                      want: list[int | None]
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None,
                                 torch.Tensor | None] | None:
        """(rows, the chosen ids' logprobs and ranks, top-k values, top-k ids) on the device;
        None when no row asks. A rank counts the tokens at least as likely (vLLM's), so the
        argmax has rank 1; -1 asks for the whole vocabulary."""
        if raw is None:
            return None
        idx, lp = raw  # [R], [R, V]
        k = max(lp.shape[1] if w == -1 else w for w in want if w is not None)
        picked = lp.gather(1, chosen[idx].unsqueeze(1))  # [R, 1]
        ranks = (lp >= picked).sum(1)  # [R]
        tv, ti = lp.topk(k, -1) if k > 0 else (None, None)
        return idx, picked.squeeze(1), ranks, tv, ti

    @staticmethod
    def _logprobs(p: PendingSample, host: list[torch.Tensor]) -> list[RawLogprobs | None]:
        """Each row's logprobs as plain data from `_logprob_rows`'s tensors (as `host` holds
        them, in that order): the chosen id first, then its top-k (batchgen_data/logprobs.py)."""
        want = p.want
        out: list[RawLogprobs | None] = [None] * len(want)
        if p.logprobs is None:
            return out
        idx, picked, ranks = host[0].tolist(), host[1].tolist(), host[2].tolist()
        tv, ti = (host[3].tolist(), host[4].tolist()) if len(host) > 3 else (None, None)
        chosen = p.host[0] if p.host is not None else p.chosen
        tokens = chosen[host[0]].tolist()
        for j, i in enumerate(idx):
            w = want[i]
            k = (len(tv[j]) if w == -1 else w) if tv is not None else 0
            out[i] = ([tokens[j], *ti[j][:k]], [picked[j], *tv[j][:k]], ranks[j]) if k else \
                ([tokens[j]], [picked[j]], ranks[j])
        return out
