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
lets a coroutine be exported mid-generation and continue elsewhere with identical tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from batchgen_data.engine.bad_words import BadWords
from batchgen_data.engine.sampling_batch import SamplingBatch
from batchgen_data.engine.sequence import Sequence
from batchgen_data.sampling_params import SamplingParams
from batchgen_data.structured.logits import StructuredLogits

_M1 = -0x40A7B892E31B1A47  # 0xBF58476D1CE4E5B9 as signed int64
_M2 = -0x6B2FB644ECCEEE15  # 0x94D049BB133111EB
_GOLDEN = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15
_SEED_MIX = 0x2545F4914F6CDD1D


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def hash_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, vocab] float32 uniforms in (0, 1) from splitmix64 of (seed, step, token)."""
    base = seeds.long() * _SEED_MIX + steps.long() * _GOLDEN  # [N]
    z = base.unsqueeze(1) + torch.arange(vocab, device=seeds.device, dtype=torch.long) * _GOLDEN
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    z = z ^ _shr(z, 31)
    return (_shr(z, 40).float() + 0.5) * (1.0 / (1 << 24))


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


class Sampler:
    def __init__(self, stop_ids_for_min_tokens: set[int], tokenizer: Any = None) -> None:
        self.eos_ids = sorted(stop_ids_for_min_tokens)
        self.bad_words = BadWords(tokenizer)
        self.structured = StructuredLogits(tokenizer, self.eos_ids)

    def check(self, params: SamplingParams, vocab_size: int) -> None:
        """The request-time checks that need the model: token ids in the vocabulary, bad words
        that tokenise (ValueError naming the field)."""
        params.check_vocab(vocab_size)
        if params.bad_words:
            self.bad_words.check(params.bad_words, vocab_size)
        self.structured.check(params, vocab_size)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        # logits [N, V] float32, row i belongs to seqs[i]
        vocab = logits.shape[1]
        b = SamplingBatch.build(seqs, vocab, self.eos_ids, logits.device, self.bad_words)
        want_lp = b.want_logprobs
        raw_logprobs = torch.log_softmax(logits, -1) if any(w is not None for w in want_lp) else None

        logits = logits.clone()
        self._edit(logits, b)
        if b.ban.shape[1]:
            logits[b.ban[0], b.ban[1]] = float("-inf")
        self.structured.apply(logits, seqs)  # grammar masks of structured_outputs rows
        self._penalties(logits, b)

        chosen = logits.argmax(-1)
        if not b.all_greedy:
            scaled = self._truncate(logits / b.temperature, b)
            u = hash_uniform(b.seed, b.step, vocab)
            sampled = (scaled - torch.log(-torch.log(u))).argmax(-1)
            chosen = torch.where(b.greedy, chosen, sampled)
        return SamplerOutput(chosen.tolist(), self._logprobs(raw_logprobs, chosen, want_lp))

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
        if b.output_ids is None:
            return
        n, vocab = logits.shape
        counts = torch.zeros(n, vocab + 1, device=logits.device)
        counts.scatter_add_(1, b.output_ids, torch.ones_like(b.output_ids, dtype=counts.dtype))
        counts = counts[:, :vocab]
        if b.prompt_ids is not None:
            seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=logits.device)
            seen.scatter_(1, b.prompt_ids, True)
            seen = seen[:, :vocab] | (counts > 0)
            rep = b.repetition
            penalised = torch.where(logits > 0, logits / rep, logits * rep)
            logits.copy_(torch.where(seen, penalised, logits))
        if b.use_freq_presence:
            logits -= b.frequency * counts + b.presence * (counts > 0).float()

    @staticmethod
    def _truncate(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        dev, vocab = logits.device, logits.shape[1]
        if b.truncate_top:
            srt, idx = logits.sort(-1, descending=True)
            rank = torch.arange(vocab, device=dev).unsqueeze(0)
            drop = rank >= b.top_k
            probs = torch.softmax(srt.masked_fill(drop, float("-inf")), -1)
            before = probs.cumsum(-1) - probs  # mass of strictly better tokens
            drop |= before >= b.top_p
            drop[:, 0] = False
            logits = logits.scatter(1, idx, srt.masked_fill(drop, float("-inf")))
        if b.use_min_p:
            probs = torch.softmax(logits, -1)
            floor = probs.max(-1, keepdim=True).values * b.min_p
            logits = logits.masked_fill(probs < floor, float("-inf"))
        return logits

    @staticmethod
    def _logprobs(raw: torch.Tensor | None, chosen: torch.Tensor, want: list[int | None]
                  ) -> list[dict[int, float] | None]:
        out: list[dict[int, float] | None] = [None] * len(want)
        if raw is None:
            return out
        k = max(w for w in want if w is not None)
        picked = raw.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
        tokens = chosen.tolist()
        tv, ti = raw.topk(k, -1) if k > 0 else (None, None)
        tv, ti = (tv.tolist(), ti.tolist()) if tv is not None else (None, None)
        for i, w in enumerate(want):
            if w is None:
                continue
            d = {tokens[i]: picked[i]}
            if w and tv is not None:
                for j in range(w):
                    d.setdefault(ti[i][j], tv[i][j])
            out[i] = d
        return out
