"""The offload cost model: which layers stream, slot count, step size, scheduler caps."""
from __future__ import annotations

import pytest

from batchgen_data.config import SchedulerConfig
from batchgen_data.worker.offload import GIB, active_fraction, device_budget, scheduler_for
from batchgen_data.worker.offload.plan import (Rates, choose_layers, make_plan, micro_batch_seqs,
                                       target_tokens)


def test_fewest_layers_that_fit_with_two_slots() -> None:
    # 8 layers of 100 + 50 other = 850; budget 500: resident + 2 slots must fit
    layers, slots = choose_layers([100] * 8, 50, 500)
    # 5 streamed: 50 + 3 * 100 + 2 * 100 = 550 > 500; 6 streamed: 50 + 200 + 200 = 450
    assert slots == 2 and layers == (2, 3, 4, 5, 6, 7)  # later layers stream first


def test_single_slot_when_two_do_not_fit() -> None:
    layers, slots = choose_layers([100] * 3, 50, 160)
    assert slots == 1 and layers == (0, 1, 2)


def test_budget_below_one_slot_is_refused() -> None:
    with pytest.raises(ValueError, match="cpu_offload_gb"):
        choose_layers([100] * 3, 50, 140)


def test_largest_layers_stream_first() -> None:
    layers, _ = choose_layers([10, 300, 10, 300], 0, 320)
    assert set(layers) >= {1, 3}


def test_target_tokens_hides_the_copy() -> None:
    # 1 GB/s copy, 1 GFLOP/s: a 1e6-byte layer of 2.5e5 params (fp32) copies in 1 ms and
    # computes 0.5 ms per token -> 2 tokens; a 1/8-active MoE needs 8x more
    rates = Rates(1e9, 1e9)
    assert target_tokens(rates, 10 ** 6, 250_000, 1.0) == 2
    assert target_tokens(rates, 10 ** 6, 250_000, 1 / 8) == 16


def test_plan_peak_within_budget() -> None:
    plan = make_plan([1000] * 10, 300, 3300, Rates(1e9, 1e11), 250)
    assert plan.peak_bytes <= plan.budget_bytes == 3300


def test_device_budget_takes_the_tighter_cap() -> None:
    assert device_budget(10 * GIB, 6.0, None) == 4 * GIB
    assert device_budget(10 * GIB, 6.0, GIB) == GIB
    assert device_budget(10 * GIB, 0.0, 20 * GIB) == 10 * GIB


def test_scheduler_raises_defaults_only() -> None:
    plan = make_plan([1000] * 10, 300, 3300, Rates(1e9, 1e13), 250)  # target 20000 tokens
    sc = scheduler_for(SchedulerConfig(), plan)
    assert sc.max_num_batched_tokens == sc.max_num_seqs == 16384  # capped
    kept = scheduler_for(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), plan,
                         given={"max_num_seqs", "max_num_batched_tokens"})
    assert (kept.max_num_seqs, kept.max_num_batched_tokens) == (8, 64)


def test_active_fraction_reads_moe_configs() -> None:
    class Cfg:
        num_experts, num_experts_per_tok = 128, 8

    assert active_fraction(Cfg()) == 1 / 16
    assert active_fraction(object()) == 1.0


def test_micro_batch_size_is_the_square_root_optimum() -> None:
    # T(m) = (n / m) * o + m * e is least at sqrt(n * o / e)
    assert micro_batch_seqs(64, exposed_s_per_seq=1e-5, call_s=1e-5) == 8
    assert micro_batch_seqs(100, exposed_s_per_seq=1e-6, call_s=4e-6) == 20


def test_micro_batch_size_responds_to_the_rates() -> None:
    base = micro_batch_seqs(256, 1e-5, 1e-5)
    # dearer fixed cost per micro-batch: fewer, larger micro-batches
    assert micro_batch_seqs(256, 1e-5, 4e-5) == 2 * base
    # a slower exposed stage (e.g. a slower link): smaller ones, a shorter pipeline fill
    assert micro_batch_seqs(256, 4e-5, 1e-5) == base // 2
    # more sequences: larger micro-batches (as the square root)
    assert micro_batch_seqs(1024, 1e-5, 1e-5) == 2 * base


def test_micro_batch_size_stays_within_one_and_all() -> None:
    assert micro_batch_seqs(10, 1.0, 1e-9) == 1
    assert micro_batch_seqs(10, 1e-9, 1.0) == 10
    assert micro_batch_seqs(10, 0.0, 1e-5) == 10  # nothing exposed: one micro-batch
