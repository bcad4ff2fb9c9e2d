"""A request's sampling values checked against what this engine can compute, when it enters.

`SamplingParams` checks each value on its own (a range, a type); some values are only wrong for
a given engine or for the arithmetic a step does with them, and a step is the worst place to
find out: every request sharing it would fail with the one that asked. So `Engine.check_request`
runs `check_limits` for every request (submit, import, the driver, the connectors' rows), and a
value past a limit is that request's `ValueError`, naming the field and the limit:

* `logprobs` / `prompt_logprobs` up to the engine's `max_logprobs` (vLLM's engine argument,
  default 20; -1: the vocabulary), with vLLM's message;
* `seed` in [-2**63, 2**64), the range `torch.manual_seed` takes (what vLLM seeds its
  generators with); a seed is its 64-bit value, so -1 and 2**64 - 1 are one seed, as in torch
  (`seed_bits`). Beyond that range two seeds would only collide silently: refused;
* `repetition_penalty` within [2**-64, 2**64]: logits are divided or multiplied by it in
  float32 (max ~2**128), so any logit below 2**64 in magnitude stays finite; a penalty that
  rounds to 0 or inf in float32 would turn a row's logits into inf / NaN and its draw into a
  token id outside the vocabulary.

`top_k` above the vocabulary is not an error: it keeps every token, as vLLM clamps it
(`SamplingBatch` clamps it before it is packed as int64).
"""
from __future__ import annotations

from batchgen_data.sampling_params import SamplingParams

SEED_MIN = -(1 << 63)
SEED_END = 1 << 64  # exclusive
PENALTY_MIN = 2.0 ** -64
PENALTY_MAX = 2.0 ** 64


def check_limits(params: SamplingParams, vocab_size: int, max_logprobs: int) -> None:
    """ValueError naming the field when `params` asks for more than this engine computes."""
    limit = vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size)
    for name, what in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        asked = getattr(params, name)
        if asked is None:
            continue
        count = vocab_size if asked == -1 else asked
        if count > limit:
            raise ValueError(f"SamplingParams.{name}={asked}: Requested {what} logprobs of "
                             f"{count}, which is greater than max allowed: {limit} (the "
                             "engine's max_logprobs)")
    seed = params.seed
    if seed is not None and not SEED_MIN <= seed < SEED_END:
        raise ValueError(f"SamplingParams.seed={seed}: must fit in 64 bits, in [-2**63, 2**64)")
    rep = params.repetition_penalty
    if not PENALTY_MIN <= rep <= PENALTY_MAX:
        raise ValueError(f"SamplingParams.repetition_penalty={rep!r}: must be in [2**-64, "
                         "2**64], so that logits divided or multiplied by it stay finite in "
                         "float32")


def seed_bits(seed: int) -> int:
    """`seed` (checked by `check_limits`) as the signed 64-bit integer with its low 64 bits:
    the value a step packs as int64 and hashes (sample/draw/draw_hash.py)."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed

