"""The plain data rank 0 broadcasts to the other ranks: a fixed header, then one int64 payload.

A step's payload is what every rank needs to run its shard of the same forward: token ids,
positions, the cache slot of each new token, each sequence's KV length and query length, the
block tables (padded to one width), the rows whose logits are sampled and those whose logits
give prompt logprobs (every rank joins those logits' gathers). Everything else a
step involves (the scheduler's choices, sampling, stopping) stays on rank 0. KV copies (hold,
resume, export, import) are a header and the block ids; their tensors follow as one collective.
With LoRA, a step also carries each token row's adapter slot, and a slot rank 0 fills is a
LORA command (the slot and the adapter's request, pickled) sent before the step that uses it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

RUN, READ_KV, WRITE_KV, STOP, LORA = 1, 2, 3, 4, 5
HEADER = 10  # int64s: [command, payload length, then the command's own numbers]


@dataclass
class StepData:
    """One forward's plain input (CPU tensors)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    seq_lens: torch.Tensor  # [num_seqs] int64: KV length after the step
    query_lens: torch.Tensor  # [num_seqs] int64
    block_tables: torch.Tensor  # [num_seqs, width] int64, decodes first
    sample_index: torch.Tensor  # [S] int64
    num_decodes: int
    # rows whose logits give prompt logprobs (`sample/prompt_logprobs.py`), [P] int64
    prompt_rows: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    # each token row's LoRA slot (-1: the base model), [T] int64; [0] without LoRA rows
    lora_slots: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))

    def pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(header, payload)."""
        t, n = self.input_ids.numel(), self.seq_lens.numel()
        width = self.block_tables.shape[1] if n else 0
        payload = torch.cat([x.reshape(-1).to(torch.int64) for x in (
            self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.query_lens,
            self.block_tables, self.sample_index, self.prompt_rows, self.lora_slots)])
        return header(RUN, payload.numel(), t, n, self.num_decodes, width,
                      self.sample_index.numel(), self.prompt_rows.numel(),
                      self.lora_slots.numel()), payload

    @classmethod
    def unpack(cls, head: torch.Tensor, payload: torch.Tensor) -> "StepData":
        t, n, nd, width, s, p, lo = head[2:9].tolist()
        sizes = [t, t, t, n, n, n * width, s, p, lo]
        ids, pos, slots, lens, qlens, tables, sample, prompt, lora = payload.split(sizes)
        return cls(ids, pos, slots, lens, qlens, tables.view(n, width), sample, nd, prompt,
                   lora)


def pack_object(obj: object) -> torch.Tensor:
    """`obj` pickled (`messages.encode`) into an int64 payload, zero-padded to whole int64s
    (the unpickler stops at its own end)."""
    from batchgen_data.worker.tp import messages

    raw = messages.encode(obj)
    padded = torch.zeros(-(-raw.numel() // 8) * 8, dtype=torch.uint8)
    padded[:raw.numel()] = raw
    return padded.view(torch.int64)


def unpack_object(payload: torch.Tensor, nbytes: int) -> object:
    from batchgen_data.worker.tp import messages

    return messages.decode(payload.view(torch.uint8)[:nbytes])


def header(command: int, payload_len: int, *numbers: int) -> torch.Tensor:
    assert len(numbers) <= HEADER - 2
    head = torch.zeros(HEADER, dtype=torch.int64)
    head[0], head[1] = command, payload_len
    head[2:2 + len(numbers)] = torch.tensor(numbers, dtype=torch.int64)
    return head
