"""One effective engine config: offload's module batching raises the step caps the user left
unset, never one the user gave (even at the default's value), once, and every reader sees the
same caps (the engine's config, its scheduler, its load report, the command's window)."""
from __future__ import annotations

from pathlib import Path

import pytest

from batchgen_data.config import SchedulerConfig, make_engine_config
from batchgen_data.engine.engine import Engine
from batchgen_data.worker import offload
from batchgen_data.worker.offload import Rates, make_plan, scheduler_for

DEFAULT = SchedulerConfig()


def test_the_config_records_what_the_user_gave() -> None:
    assert make_engine_config(None).given == frozenset()
    config = make_engine_config(None, max_num_seqs=256, swap_space=1)  # vLLM's name, mapped
    assert config.given == {"max_num_seqs", "held_kv_bytes"}
    assert config.scheduler.max_num_seqs == DEFAULT.max_num_seqs  # the value alone cannot tell


def test_module_batching_keeps_the_caps_given() -> None:
    plan = make_plan([1000] * 10, 300, 3300, Rates(1e9, 1e13), 250)  # wants 16384-token steps
    raised = scheduler_for(DEFAULT, plan)
    assert raised.max_num_seqs == raised.max_num_batched_tokens == 16384
    kept = scheduler_for(DEFAULT, plan, given={"max_num_seqs"})
    assert (kept.max_num_seqs, kept.max_num_batched_tokens) == (256, 16384)


def test_every_reader_sees_the_resolved_caps(deep_llama: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from batchgen_data.cli.runner_local import LocalRunner

    # copies far slower than compute: the plan asks for large steps (the measured rates of
    # the CPU "device" would not raise the caps at all)
    monkeypatch.setattr(offload, "measure_rates", lambda *a: Rates(1e9, 1e13))
    total = offload.weight_bytes(Engine.from_kwargs(str(deep_llama), cpu_kernels=False)
                                 .runner.model)
    kw = {"cpu_kernels": False, "weight_memory_bytes": total // 4}  # most layers stream
    unset = Engine.from_kwargs(str(deep_llama), **kw)
    sc = unset.config.scheduler
    assert unset.runner.weight_store is not None  # it streams: module batching applies
    assert sc.max_num_seqs > DEFAULT.max_num_seqs
    assert sc.max_num_batched_tokens > DEFAULT.max_num_batched_tokens
    assert unset.scheduler.config == sc and unset.load().max_num_seqs == sc.max_num_seqs
    given = Engine.from_kwargs(str(deep_llama), max_num_seqs=256, **kw)
    assert given.config.scheduler.max_num_seqs == given.load().max_num_seqs == 256
    assert given.config.scheduler.max_num_batched_tokens == sc.max_num_batched_tokens
    runner = LocalRunner(str(deep_llama), kw)  # the command's window: two engine batches
    assert runner.max_in_flight == 2 * sc.max_num_seqs
