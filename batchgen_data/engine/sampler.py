"""Vectorised sampling: penalties, min_tokens, greedy, temperature, top-k, top-p, min-p, logprobs.

No per-sequence Python loop touches the logits. Random sampling uses the exponential-race trick
(argmax of log p - log E, E ~ Exp(1)), with E drawn from a counter-based hash of
(sequence seed, output index, token id). That makes a seeded sequence's tokens independent of
whatever else shares its batch, of the batch size, and of the engine it runs on — which is what
lets a coroutine be exported mid-generation and continue elsewhere with identical tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen_data.engine.sequence import Sequence

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
    def __init__(self, stop_ids_for_min_tokens: set[int]) -> None:
        self.eos_ids = sorted(stop_ids_for_min_tokens)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        # logits [N, V] float32, row i belongs to seqs[i]
        dev = logits.device
        n, vocab = logits.shape
        params = [s.params for s in seqs]
        want_lp = [p.logprobs for p in params]
        raw_logprobs = torch.log_softmax(logits, -1) if any(w is not None for w in want_lp) else None

        logits = logits.clone()
        self._min_tokens(logits, seqs)
        self._penalties(logits, seqs)

        temps = [p.temperature for p in params]
        greedy = torch.tensor([p.greedy for p in params], device=dev)
        chosen = logits.argmax(-1)
        if not bool(greedy.all()):
            t = torch.tensor([max(x, 1e-5) for x in temps], device=dev).unsqueeze(1)
            scaled = self._truncate(logits / t, params)
            seeds = torch.tensor([s.seed for s in seqs], device=dev)
            steps = torch.tensor([s.num_output_tokens for s in seqs], device=dev)
            u = hash_uniform(seeds, steps, vocab)
            sampled = (scaled - torch.log(-torch.log(u))).argmax(-1)
            chosen = torch.where(greedy, chosen, sampled)
        tokens = chosen.tolist()
        return SamplerOutput(tokens, self._logprobs(raw_logprobs, tokens, want_lp))

    def _min_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        for i, s in enumerate(seqs):
            if s.num_output_tokens < s.params.min_tokens:
                banned = list(s.params.stop_token_ids) + ([] if s.params.ignore_eos else self.eos_ids)
                if banned:
                    logits[i, banned] = float("-inf")

    def _penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        ps = [s.params for s in seqs]
        if all(p.repetition_penalty == 1 and p.presence_penalty == 0 and p.frequency_penalty == 0
               for p in ps):
            return
        dev, (n, vocab) = logits.device, logits.shape
        out_ids = _pad([s.output_token_ids for s in seqs], vocab, dev)  # [N, Lo], pad = vocab
        counts = torch.zeros(n, vocab + 1, device=dev)
        counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=counts.dtype))
        counts = counts[:, :vocab]
        rep = torch.tensor([p.repetition_penalty for p in ps], device=dev).unsqueeze(1)
        if bool((rep != 1).any()):
            seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=dev)
            seen.scatter_(1, _pad([s.prompt_token_ids for s in seqs], vocab, dev), True)
            seen = seen[:, :vocab] | (counts > 0)
            penalised = torch.where(logits > 0, logits / rep, logits * rep)
            logits.copy_(torch.where(seen, penalised, logits))
        freq = torch.tensor([p.frequency_penalty for p in ps], device=dev).unsqueeze(1)
        pres = torch.tensor([p.presence_penalty for p in ps], device=dev).unsqueeze(1)
        logits -= freq * counts + pres * (counts > 0).float()

    @staticmethod
    def _truncate(logits: torch.Tensor, params: list) -> torch.Tensor:  # type: ignore[type-arg]
        dev, vocab = logits.device, logits.shape[1]
        top_k = [p.top_k if p.top_k > 0 else vocab for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        if any(k < vocab for k in top_k) or any(p < 1 for p in top_p):
            srt, idx = logits.sort(-1, descending=True)
            rank = torch.arange(vocab, device=dev).unsqueeze(0)
            drop = rank >= torch.tensor(top_k, device=dev).unsqueeze(1)
            probs = torch.softmax(srt.masked_fill(drop, float("-inf")), -1)
            before = probs.cumsum(-1) - probs  # mass of strictly better tokens
            drop |= before >= torch.tensor(top_p, device=dev).unsqueeze(1)
            drop[:, 0] = False
            logits = logits.scatter(1, idx, srt.masked_fill(drop, float("-inf")))
        if any(p > 0 for p in min_p):
            probs = torch.softmax(logits, -1)
            floor = probs.max(-1, keepdim=True).values * torch.tensor(min_p, device=dev).unsqueeze(1)
            logits = logits.masked_fill(probs < floor, float("-inf"))
        return logits

    @staticmethod
    def _logprobs(raw: torch.Tensor | None, tokens: list[int], want: list[int | None]
                  ) -> list[dict[int, float] | None]:
        out: list[dict[int, float] | None] = [None] * len(tokens)
        if raw is None:
            return out
        k = max(w for w in want if w is not None)
        top_v, top_i = raw.topk(k, -1) if k > 0 else (None, None)
        picked = raw.gather(1, torch.tensor(tokens, device=raw.device).unsqueeze(1)).squeeze(1)
        picked_l, = (picked.tolist(),)
        tv, ti = (top_v.tolist(), top_i.tolist()) if top_v is not None else (None, None)
        for i, w in enumerate(want):
            if w is None:
                continue
            d = {tokens[i]: picked_l[i]}
            if w and tv is not None:
                for j in range(w):
                    d.setdefault(ti[i][j], tv[i][j])
            out[i] = d
        return out


def _pad(rows: list[list[int]], pad: int, dev: torch.device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=dev)
