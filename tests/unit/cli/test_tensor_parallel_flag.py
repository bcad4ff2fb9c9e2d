"""`batchgen-data run --tensor-parallel-size N` is the engine kwarg tensor_parallel_size=N."""
from __future__ import annotations

import argparse
import importlib

import pytest

cli_main = importlib.import_module("batchgen_data.cli.main")  # (the package exports its main())


def test_flag_becomes_the_engine_kwarg(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[argparse.Namespace] = []

    class FakeJob:
        def __init__(self, args: argparse.Namespace) -> None:
            seen.append(args)

        def run(self) -> int:
            return 0

    monkeypatch.setattr(cli_main, "Job", FakeJob)
    assert cli_main.main(["run", "in.jsonl", "-o", "out.jsonl", "--runner", "local",
                          "--tensor-parallel-size", "2",
                          "--engine-kwargs", '{"max_num_seqs": 8}']) == 0
    assert seen[0].engine_kwargs == {"max_num_seqs": 8, "tensor_parallel_size": 2}


def test_bad_value_is_named() -> None:
    with pytest.raises(SystemExit, match="--tensor-parallel-size=0"):
        cli_main.main(["run", "in.jsonl", "-o", "out.jsonl", "--runner", "local",
                       "--tensor-parallel-size", "0"])
