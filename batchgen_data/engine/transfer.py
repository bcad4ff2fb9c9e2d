"""A request as plain data and back (`Engine.export` / `Engine.import_`, docs/ENGINE_API.md).

The state holds the request's prompt, parameters and adapter, and per sample its generated
tokens, seed, stop state, logprobs and, when asked, its KV with what its bytes mean
(worker/kv_format.py: dtype, FP8 scales). Lists, numbers and tensors only, so it pickles to
another process; the importing engine continues each sample where it stopped, so greedy and
seeded tokens are those of a run that never moved.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from batchgen_data.core.kv.held_kv import HeldKVStore
from batchgen_data.core.request import Request
from batchgen_data.core.kv.held_kv import decide_held_kv
from batchgen_data.core.sequence import Sequence, SequenceStatus
from batchgen_data.lora_request import LoRARequest
from batchgen_data.sampling_params import SamplingParams
from batchgen_data.worker import kv_format
from batchgen_data.worker.runner import Runner


def export_request(req: Request, held_kv: HeldKVStore, runner: Runner,
                   include_kv: bool) -> dict[str, Any]:
    """The state of `req`, a request held and taken out of its engine; its held KV (copied
    into the state when `include_kv`) leaves the store."""
    seqs = []
    for seq in req.seqs:
        state = seq.to_state()
        state["finish"] = int(seq.status) if seq.status.finished else None
        state["stop_reason"] = seq.stop_reason
        if include_kv and seq.held_kv is not None:
            state["kv"] = [(c := k.clone(), c if v is k else v.clone())  # one plane: once
                           for k, v in seq.held_kv]
            state["kv_format"] = kv_format.state_of(runner)  # dtype, FP8 scales
        held_kv.drop(seq)
        seqs.append(state)
    return {"request_id": req.request_id, "prompt": req.prompt,
            "prompt_token_ids": list(req.prompt_token_ids), "params": req.params.to_dict(),
            "seqs": seqs, "lora": None if req.lora is None else req.lora.to_dict(),
            "alone": any(s.alone for s in req.seqs)}


def import_request(state: dict[str, Any], params: SamplingParams, lora: LoRARequest | None,
                   seq_ids: Iterator[int], held_kv: HeldKVStore, runner: Runner) -> Request:
    """The request of an exported `state` (its prompt and parameters already checked by the
    importing engine), its samples numbered from `seq_ids`; shipped KV is adopted into this
    engine's format and kept in the held-KV store when it fits (`decide_held_kv`), else
    recomputed when the sample runs."""
    rid = state["request_id"]
    req = Request(rid, state.get("prompt"), list(state["prompt_token_ids"]), params, lora=lora)
    for st in state["seqs"]:
        seq = Sequence(next(seq_ids), rid, st["index"], req.prompt_token_ids, params,
                       st["seed"], st["max_tokens"],
                       token_ids=req.prompt_token_ids + list(st["output_token_ids"]),
                       num_cached_tokens=st.get("num_cached_tokens", 0),
                       logprobs=st.get("logprobs"), stop_reason=st.get("stop_reason"),
                       prompt_logprobs=st.get("prompt_logprobs"), lora=lora,
                       alone=bool(state.get("alone", False)))
        if st.get("finish") is not None:
            seq.status = SequenceStatus(st["finish"])
        elif st.get("kv") is not None:
            kv = kv_format.adopt(st["kv"], st.get("kv_format"), runner)
            seq.num_computed_tokens = kv[0][0].shape[0]
            if decide_held_kv(seq, held_kv, keep=True):
                held_kv.put(seq, kv)
        req.seqs.append(seq)
    return req
