"""A step's plain data survives its trip from rank 0 (worker/tp/step_io.py)."""
from __future__ import annotations

import torch

from batchgen_data.worker.tp import step_io


def test_step_data_round_trips() -> None:
    data = step_io.StepData(
        input_ids=torch.tensor([5, 6, 7, 8, 9]), positions=torch.tensor([3, 0, 1, 2, 9]),
        slot_mapping=torch.tensor([11, 16, 17, 18, 41]), seq_lens=torch.tensor([4, 3, 10]),
        query_lens=torch.tensor([1, 3, 1]), block_tables=torch.tensor([[2, 0], [4, 0], [9, 10]]),
        sample_index=torch.tensor([0, 3, 4]), num_decodes=1, prompt_rows=torch.tensor([1, 2]),
        lora_slots=torch.tensor([1, -1, -1, -1, 0]))
    head, payload = data.pack()
    assert head.shape == (step_io.HEADER,) and int(head[0]) == step_io.RUN
    assert int(head[1]) == payload.numel()
    back = step_io.StepData.unpack(head, payload)
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "query_lens",
                 "block_tables", "sample_index", "prompt_rows", "lora_slots"):
        assert torch.equal(getattr(back, name), getattr(data, name)), name
    assert back.num_decodes == 1


def test_header_carries_a_command_and_its_numbers() -> None:
    head = step_io.header(step_io.WRITE_KV, 3, 17)
    assert head.tolist() == [step_io.WRITE_KV, 3, 17] + [0] * (step_io.HEADER - 3)


def test_a_step_without_lora_rows_carries_no_slots() -> None:
    data = step_io.StepData(torch.tensor([5]), torch.tensor([0]), torch.tensor([3]),
                            torch.tensor([1]), torch.tensor([1]), torch.tensor([[0]]),
                            torch.tensor([0]), 0)
    back = step_io.StepData.unpack(*data.pack())
    assert back.lora_slots.numel() == 0 and torch.equal(back.input_ids, data.input_ids)


def test_an_object_travels_as_an_int64_payload() -> None:
    """A LORA command's request: pickled, padded to whole int64s, the byte count in the
    header."""
    from batchgen_data import LoRARequest

    req = LoRARequest("a0", 3, "/some/adapter")
    blob = step_io.pack_object(req)
    assert blob.dtype == torch.int64
    import pickle

    n = len(pickle.dumps(req, protocol=pickle.HIGHEST_PROTOCOL))
    assert step_io.unpack_object(blob, n) == req
