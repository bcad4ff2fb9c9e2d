"""Per-row sampling parameters of one step, built on the host and moved to the device at once.

Building a small tensor per parameter costs one host-to-device copy each, and on a GPU each
of those copies (and every `bool(device_tensor)`) can stall the host. Here every per-row value
— seeds, output indices, top-k, temperatures, penalties, the min_tokens bans and, when
penalties are on, the padded token histories — goes into one host buffer, is copied with one
non-blocking transfer from pinned memory, and is unpacked into views on the device. Decisions
about which sampling stages to run are made from host-side flags, never from device values.

Rows that edit their logits (logit_bias, allowed_token_ids, bad_words) add (row, token) pairs
to the same buffer; a step whose rows set none of those builds nothing extra for them.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, is_

import numpy as np
import torch

from batchgen_data.sample.bad_words import BadWords, banned_tokens
from batchgen_data.core.sequence import Sequence
from batchgen_data.sampling_params import SamplingParams


_EDITS_LOGITS = attrgetter("edits_logits")
_PARAMS = attrgetter("params")
_SEED = attrgetter("seed")
_TOKEN_IDS = attrgetter("token_ids")
_PROMPT_IDS = attrgetter("prompt_token_ids")


def to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Move host tensors to `device` with one copy (pinned and non-blocking on CUDA)."""
    if device.type == "cpu":
        return tensors
    host = pack(tensors)
    if device.type == "cuda":
        host = host.pin_memory()
    return unpack(host.to(device, non_blocking=True), tensors)


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes end to end, as one uint8 tensor. List them by non-increasing element
    size so that `unpack` finds every tensor at an offset aligned for its dtype."""
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])


def unpack(buf: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views into `buf` (made by `pack(like)`, on any device) with the shapes of `like`."""
    out, offset = [], 0
    for t in like:
        assert offset % t.element_size() == 0, "pack tensors by non-increasing element size"
        nbytes = t.numel() * t.element_size()
        out.append(buf[offset:offset + nbytes].view(t.dtype).view(t.shape))
        offset += nbytes
    assert offset == buf.numel()
    return out


def pad_rows(rows: list[list[int]], pad: int) -> torch.Tensor:
    """[N, max(1, longest row)] int64, right-padded with `pad`."""
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long)


@dataclass
class SamplingBatch:
    # host-side flags: which stages run this step
    all_greedy: bool
    any_greedy: bool
    truncate_top: bool  # some row has top_k or top_p
    use_min_p: bool
    use_repetition: bool
    use_freq_presence: bool
    want_logprobs: list[int | None]
    constrained: bool  # some row has structured_outputs (a grammar mask)
    # device tensors, one row per sequence
    seed: torch.Tensor  # [N] int64
    step: torch.Tensor  # [N] int64: the index of the token being drawn
    top_k: torch.Tensor  # [N, 1] int64 (vocab when disabled)
    ban: torch.Tensor  # [2, M] int64: (row, token) pairs banned by min_tokens and bad_words
    output_ids: torch.Tensor | None  # [N, Lo] int64 padded with vocab (penalties only)
    prompt_ids: torch.Tensor | None  # [N, Lp] int64 padded with vocab (repetition only)
    temperature: torch.Tensor  # [N, 1] float32, at least 1e-5
    top_p: torch.Tensor  # [N, 1]
    min_p: torch.Tensor  # [N, 1]
    repetition: torch.Tensor  # [N, 1]
    frequency: torch.Tensor  # [N, 1]
    presence: torch.Tensor  # [N, 1]
    greedy: torch.Tensor  # [N] bool
    # logit edits, None when no row has them
    allowed: torch.Tensor | None = None  # [2, A] int64: (row, token) pairs that stay sampleable
    allowed_rows: torch.Tensor | None = None  # [R] int64: rows restricted to their pairs
    bias_at: torch.Tensor | None = None  # [2, K] int64: (row, token) pairs of logit_bias
    bias: torch.Tensor | None = None  # [K] float32

    @classmethod
    def build(cls, seqs: list[Sequence], vocab: int, eos_ids: list[int],
              device: torch.device, bad_words: BadWords | None = None
              ) -> "SamplingBatch | None":
        """The step's batch, or None when every row is greedy with nothing that changes or
        reports its logits (the argmax alone decides: nothing to build or copy)."""
        n = len(seqs)
        ps = list(map(_PARAMS, seqs))
        # the rows' distinct SamplingParams objects (a request's rows share one, and often a
        # whole step does): per-parameter values are read once per object, not once per row
        if n and all(map(is_, ps, repeat(ps[0]))):  # one object for the whole step
            keys, uniq = None, ps[:1]
        else:
            keys = list(map(id, ps))
            first = dict(zip(keys, ps))
            uniq = list(first.values())
        if all(map(_argmax_only, uniq)):
            return None
        if len(uniq) == 1:
            code = np.zeros(n, dtype=np.int64)
        else:
            where = {k: j for j, k in enumerate(first)}
            code = np.fromiter(map(where.__getitem__, keys), np.int64, n)  # [N] row's object
        edits = ([i for i, p in enumerate(ps) if p.edits_logits]
                 if any(map(_EDITS_LOGITS, uniq)) else [])
        output_len = (np.fromiter(map(len, map(_TOKEN_IDS, seqs)), np.int64, n)
                      - np.fromiter(map(len, map(_PROMPT_IDS, seqs)), np.int64, n))
        # a top_k above the vocabulary keeps every token (vLLM clamps it), and must fit int64
        top_k = np.array([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in uniq],
                         dtype=np.int64)
        ints = np.stack([np.fromiter(map(_SEED, seqs), np.int64, n), output_len,
                         top_k[code]], axis=1)  # [N, 3]
        floats = np.array([[max(p.temperature, 1e-5), p.top_p, p.min_p, p.repetition_penalty,
                            p.frequency_penalty, p.presence_penalty] for p in uniq],
                          dtype=np.float32)[code]  # [N, 6]
        greedy = np.array([p.greedy for p in uniq], dtype=np.bool_)[code]  # [N]
        use_rep = any(p.repetition_penalty != 1 for p in uniq)
        use_fp = any(p.frequency_penalty != 0 or p.presence_penalty != 0 for p in uniq)
        bans = (_min_tokens_bans(seqs, eos_ids, vocab) if any(p.min_tokens for p in uniq)
                else [[], []])
        edit = _logit_edits(seqs, edits, bans, bad_words) if edits else {}
        ban = torch.tensor(bans, dtype=torch.long).view(2, -1)
        history = []
        if use_rep or use_fp:
            history.append(pad_rows([s.output_token_ids for s in seqs], vocab))
        if use_rep:
            history.append(pad_rows([s.prompt_token_ids for s in seqs], vocab))
        # int64 tensors first, then float32, then bool: `pack` needs non-increasing sizes
        names = sorted(edit, key=lambda k: -edit[k].element_size())
        longs = [torch.from_numpy(ints), ban, *history]
        moved = to_device(longs + [edit[k] for k in names]
                          + [torch.from_numpy(floats), torch.from_numpy(greedy)], device)
        ints_d, ban_d, *hist_d = moved[:len(longs)]
        floats_d, greedy_d = moved[-2:]
        f = floats_d.unbind(1)
        return cls(
            all_greedy=all(p.greedy for p in uniq), any_greedy=any(p.greedy for p in uniq),
            truncate_top=any(0 < p.top_k < vocab or p.top_p < 1 for p in uniq),
            use_min_p=any(p.min_p > 0 for p in uniq),
            use_repetition=use_rep, use_freq_presence=use_fp,
            want_logprobs=([p.logprobs for p in ps] if any(p.logprobs is not None for p in uniq)
                           else [None] * n),
            constrained=any(p.structured_outputs is not None for p in uniq),
            seed=ints_d[:, 0], step=ints_d[:, 1], top_k=ints_d[:, 2:3], ban=ban_d,
            output_ids=hist_d[0] if hist_d else None,
            prompt_ids=hist_d[1] if use_rep else None,
            temperature=f[0].unsqueeze(1), top_p=f[1].unsqueeze(1), min_p=f[2].unsqueeze(1),
            repetition=f[3].unsqueeze(1), frequency=f[4].unsqueeze(1),
            presence=f[5].unsqueeze(1), greedy=greedy_d,
            **dict(zip(names, moved[len(longs):-2])))


def _argmax_only(p: SamplingParams) -> bool:
    """Greedy, and nothing edits the logits or reads them (penalties, bans, masks, logprobs)."""
    return (p.greedy and not p.edits_logits and not p.min_tokens and p.logprobs is None
            and p.repetition_penalty == 1 and not p.frequency_penalty
            and not p.presence_penalty and p.structured_outputs is None)


def _min_tokens_bans(seqs: list[Sequence], eos_ids: list[int], vocab: int) -> list[list[int]]:
    """[rows, tokens]: stop and EOS ids banned until a sequence has its min_tokens."""
    rows: list[int] = []
    cols: list[int] = []
    for i, s in enumerate(seqs):
        p = s.params
        if s.num_output_tokens < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
            ids = sorted(t for t in banned if t < vocab)  # ids past the vocab never get sampled
            rows += [i] * len(ids)
            cols += ids
    return [rows, cols]


def _logit_edits(seqs: list[Sequence], rows: list[int], bans: list[list[int]],
                 bad_words: BadWords | None) -> dict[str, torch.Tensor]:
    """Host tensors of the `SamplingBatch` edit fields that these rows use; their bad-word bans
    are appended to `bans` ([rows, tokens], shared with min_tokens)."""
    allowed: list[list[int]] = [[], []]
    allowed_rows: list[int] = []
    bias_at: list[list[int]] = [[], []]
    bias: list[float] = []
    for i in rows:
        s = seqs[i]
        p = s.params
        if p.allowed_token_ids:
            allowed_rows.append(i)
            allowed[0] += [i] * len(p.allowed_token_ids)
            allowed[1] += p.allowed_token_ids
        if p.logit_bias:
            bias_at[0] += [i] * len(p.logit_bias)
            bias_at[1] += list(p.logit_bias)
            bias += list(p.logit_bias.values())
        if p.bad_words:
            assert bad_words is not None, "bad_words need the engine's BadWords"
            ids = banned_tokens(bad_words.spellings(p.bad_words), s.token_ids, s.num_prompt_tokens)
            bans[0] += [i] * len(ids)
            bans[1] += ids
    out: dict[str, torch.Tensor] = {}
    if allowed_rows:
        out["allowed"] = torch.tensor(allowed, dtype=torch.long)
        out["allowed_rows"] = torch.tensor(allowed_rows, dtype=torch.long)
    if bias:
        out["bias_at"] = torch.tensor(bias_at, dtype=torch.long)
        out["bias"] = torch.tensor(bias, dtype=torch.float32)
    return out
