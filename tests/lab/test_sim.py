"""Cluster simulator: exactness of the extrapolated decode runs, row accounting, mode ordering."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from batchgen_data.placement import PlacementConfig
from batchgen_data.sampling_params import SamplingParams
from batchgen_lab.sim import (MODES, PRESETS, Cluster, CostModel, EngineShape, ModeConfig, compare,
                               make_workload, mode_config, simulate)
from batchgen_lab.sim.__main__ import main
from batchgen_lab.sim.actor import MAX_FINISHES_CAP, SimActor
from batchgen_lab.sim.calibrate import calibrate, fit
from batchgen_lab.sim.workload import Workload

# a cost model where batch size matters (CPU-like): per-sequence work is not hidden
LINEAR = CostModel("test-linear", c0=2e-3, c_tok=50e-6, c_kv=2e-7, c_seq=0.4e-3,
                   bytes_per_token=4096, kv_capacity_tokens=200_000,
                   pcie_bytes_per_s=10e9, link_bytes_per_s=5e9)


def heavy_tail(rows: int, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    out = np.minimum(np.rint(rng.lognormal(4.5, 1.2, rows)), 2048).astype(np.int64) + 1
    return Workload("tail", rng.integers(32, 257, rows), out, 2049)


def reference_bct(wl: Workload, cost: CostModel, shape: EngineShape) -> float:
    """One engine, every row queued at t=0, the real scheduler called at every single step."""
    actor = SimActor(0, cost, shape)
    params = SamplingParams(max_tokens=wl.max_output, ignore_eos=True)
    for r in range(wl.num_rows):
        actor.add_row(r, int(wl.input_lens[r]), int(wl.output_lens[r]), params)
    t = 0.0
    while (stepped := actor.step(t)) is not None:
        t = stepped[0]
    return t


@pytest.mark.parametrize("preset", ["h200-llama8b", "test-linear", "roofline"])
@pytest.mark.parametrize("kv_tokens", [1_000_000, 6_000])  # ample memory / preemptions
def test_decode_runs_match_step_by_step_scheduling(preset: str, kv_tokens: int) -> None:
    base = {"test-linear": LINEAR, "roofline": replace(PRESETS["h200-llama8b"], overlap=True)}
    cost = replace(base.get(preset) or PRESETS[preset], kv_capacity_tokens=kv_tokens)
    wl = heavy_tail(40, seed=1)
    shape = EngineShape(max_num_seqs=8, max_num_batched_tokens=512, block_size=16,
                        host_kv_bytes=64 * cost.bytes_per_token, max_finishes=1)
    mode = ModeConfig("continuous", placement=PlacementConfig(queue_depth=1000))
    ref = reference_bct(wl, cost, shape)
    assert Cluster(wl, 1, cost, shape, mode).run().bct_s == pytest.approx(ref, rel=1e-9)


def test_decode_run_time_is_the_sum_of_step_times() -> None:
    roofline = replace(PRESETS["h200-llama8b"], overlap=True)
    for cost in (PRESETS["h200-llama8b"], PRESETS["a100-qwen0.5b"], LINEAR, roofline):
        for n, kv, a, b in [(1, 900, 1, 5000), (256, 256 * 800, 3, 40), (40, 60, 1, 1)]:
            brute = sum(cost.step_time(n, kv + (j - 1) * n, n) for j in range(a, b + 1))
            assert cost.decode_steps_time(n, kv, a, b) == pytest.approx(brute, rel=1e-9)


def test_every_row_finishes_exactly_once_and_nothing_leaks() -> None:
    wl = heavy_tail(1500, seed=2)
    shape = EngineShape(max_num_seqs=32, host_kv_bytes=1 << 24)
    for name in MODES:
        c = Cluster(wl, 6, LINEAR, shape, mode_config(name, 32, batch_size=4,
                                                       max_concurrent_batches=8))
        res = c.run()
        assert res.rows_finished == wl.num_rows and not np.isnan(c.finish).any()
        assert (c.finished_by >= 0).all()
        assert sum(c.in_flight) == 0 and all(n == 0 for n in c.batch_left)
        assert c.next_batch == c.num_batches and not any(c.exports) and not any(c.inbound)
        for a in c.actors:
            assert not a.has_work() and not a.live
            assert a.pool.num_free == a.pool.num_blocks and a.held_kv.used_bytes == 0
        assert res.bct_s == pytest.approx(float(np.max(c.finish)))
        assert res.idle_gpu_s >= 0 and res.bct_s >= res.tail_floor_s
        if name == "static":  # never more rows at once than batches x batch size
            assert max(n for tr in res.traces for _, n in tr) <= 32
        if name == "migrate":
            assert res.moved.get("running", 0) > 0  # exports and imports were exercised
            assert res.moved.get("kv_shipped", 0) > 0


def test_migration_beats_streaming_beats_static_on_a_heavy_tail() -> None:
    res = compare(heavy_tail(3000, seed=3), 8, LINEAR, EngineShape(max_num_seqs=32),
                  batch_size=4, max_concurrent_batches=8)
    static, continuous, migrate = (res[m].bct_s for m in ("static", "continuous", "migrate"))
    assert migrate < continuous < static
    assert res["migrate"].idle_gpu_s < res["continuous"].idle_gpu_s


def test_coarse_runs_stay_close_to_exact_admission() -> None:
    # with the linear cost model, delaying a freed seat by a few finishes barely matters
    wl = make_workload("uniform", 1200, seed=0)
    cost = PRESETS["h200-llama8b"]
    exact = simulate(wl, 2, cost, mode_config("continuous", 64), EngineShape(64, max_finishes=1))
    coarse = simulate(wl, 2, cost, mode_config("continuous", 64), EngineShape(64))
    assert coarse.spans < exact.spans / 2
    assert coarse.bct_s == pytest.approx(exact.bct_s, rel=0.02)


def test_engine_shape_follows_the_presets_vllm_defaults() -> None:
    # vLLM's LLM-class defaults: >= 70 GiB and not an A100 -> 1024 / 16384, else 256 / 8192
    h200, a100, cpu = (EngineShape.for_cost(PRESETS[p])
                       for p in ("h200-llama8b", "a100-qwen0.5b", "cpu-smollm2"))
    assert (h200.max_num_seqs, h200.max_num_batched_tokens) == (1024, 16384)
    assert (a100.max_num_seqs, a100.max_num_batched_tokens) == (256, 8192)
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens) == (256, 16384)
    assert EngineShape.for_cost(PRESETS["h200-llama8b"], 256).max_num_seqs == 256
    assert EngineShape.for_cost(LINEAR) == EngineShape()
    assert h200.finishes_per_run == MAX_FINISHES_CAP and EngineShape(64).finishes_per_run == 4
    assert EngineShape(1024, max_finishes=1).finishes_per_run == 1


def test_static_keeps_ray_data_llm_rows_in_flight_whatever_the_seats() -> None:
    cost = replace(LINEAR, max_num_seqs=1024)
    res = simulate(heavy_tail(1200, seed=4), 2, cost, mode_config("static", 1024))
    assert max(n for tr in res.traces for _, n in tr) <= 32 * 8  # batch_size x batches


def test_static_batches_return_at_the_step_their_last_row_finishes() -> None:
    # seats to spare and ample memory: nobody ever waits for a seat, so coarse decode runs are
    # exact as long as a run ends where a batch completes (also in the span's real step)
    wl = heavy_tail(600, seed=5)
    cost = replace(LINEAR, kv_capacity_tokens=1_000_000)
    runs = [simulate(wl, 3, cost, mode_config("static", 512, batch_size=8,
                                              max_concurrent_batches=4),
                     EngineShape(512, max_finishes=f)) for f in (1, 8, 32)]
    assert runs[1].bct_s == pytest.approx(runs[0].bct_s, rel=1e-9)
    assert runs[2].bct_s == pytest.approx(runs[0].bct_s, rel=1e-9)
    assert runs[2].spans < runs[0].spans


def test_workloads_follow_their_distributions() -> None:
    wl = make_workload("reasoning", 20_000, seed=0)
    assert wl.input_lens.max() <= 8192 and wl.output_lens.max() <= 16384
    assert np.median(wl.input_lens) == pytest.approx(np.exp(6.5), rel=0.05)
    assert np.median(wl.output_lens) == pytest.approx(np.exp(6.0), rel=0.05)
    uni = make_workload("uniform", 1000, seed=0)
    assert uni.output_lens.min() >= 64 and uni.output_lens.max() <= 1024
    with pytest.raises(ValueError, match="workload"):
        make_workload("poetry", 10)


def test_calibration_fit_recovers_known_constants() -> None:
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(200):
        new, kv, seqs = int(rng.integers(1, 2000)), int(rng.integers(0, 50_000)), int(rng.integers(1, 64))
        rows.append((new, kv, seqs, 3e-3 + 2e-5 * new + 1e-7 * kv + 4e-4 * seqs))
    cm = fit(rows, LINEAR, "fitted", "synthetic")
    assert (cm.c0, cm.c_tok, cm.c_kv, cm.c_seq) == pytest.approx((3e-3, 2e-5, 1e-7, 4e-4), rel=1e-6)


def test_fit_recovers_known_constants() -> None:
    from batchgen_lab.sim.calibrate import fit

    rng = np.random.default_rng(0)
    truth = (2e-3, 3e-5, 2e-7, 5e-4)
    rows = []
    for _ in range(40):
        new, kv = int(rng.integers(1, 2048)), int(rng.integers(0, 50000))
        seqs = int(rng.integers(1, 64))
        rows.append((new, kv, seqs, truth[0] + truth[1] * new + truth[2] * kv + truth[3] * seqs))
    base = CostModel("t", 0.0, 0.0, 0.0, 0.0, bytes_per_token=512, kv_capacity_tokens=1000,
                     pcie_bytes_per_s=1e10, link_bytes_per_s=1e9)
    cm = fit(rows, base, "t", "synthetic")
    assert (cm.c0, cm.c_tok, cm.c_kv, cm.c_seq) == pytest.approx(truth, rel=1e-6)
    # a feature that makes steps faster cannot get a negative cost: it is dropped, the rest refit
    rows = [(n, kv, s, 1e-3 + 1e-5 * n - 1e-4 * s) for n, kv, s, _ in rows]
    cm = fit(rows, base, "t", "synthetic")
    assert cm.c_seq == 0.0 and min(cm.c0, cm.c_tok, cm.c_kv) >= 0.0


def test_calibrate_times_the_real_engine(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    import torch

    runs = [(64, 1, 1), (512, 1, 1), (32, 2, 6), (32, 8, 6), (256, 8, 6)]
    threads = torch.get_num_threads()
    try:  # one thread: a tiny model gains nothing from more, and the suite shares the CPU
        cm, diag = calibrate(str(tiny_model_dir("llama")), repeats=1, runs=runs, num_threads=1)
    finally:
        torch.set_num_threads(threads)
    assert cm.bytes_per_token == 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, fp32
    # every step of every run was timed: one prefill step each, then one per further token
    assert diag["steps"] == sum(out for _, _, out in runs)
    # a least-squares fit with an intercept reproduces the total measured time exactly (the
    # residuals sum to zero); a broken fit or mislabelled step times break this
    assert cm.c0 > 0 and diag["total_time_ratio"] == pytest.approx(1.0, abs=1e-6)
    assert cm.step_time(512, 512, 1) > cm.step_time(1, 32, 1) > 0


def test_command_line_prints_json_and_plots(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    # the report is read from its own file: the suite's Ray driver may print a cluster message
    # ("(raylet) A worker died ...") into this test's stdout at any time
    png, out_file = tmp_path / "active.png", tmp_path / "report.json"
    assert main(["--actors", "3", "--rows", "300", "--json", "--jobs", "1",
                 "--plot", str(png), "--json-out", str(out_file)]) == 0
    report = json.loads(out_file.read_text())
    assert json.dumps(report) in capsys.readouterr().out.splitlines()  # --json printed it too
    assert set(report["modes"]) == set(MODES)
    assert report["modes"]["migrate"]["rows_finished"] == 300
    assert "speedup_migrate_vs_static" in report
    assert png.stat().st_size > 10_000
    assert report["engine"]["max_num_seqs"] == 1024  # the h200 preset's vLLM default
    assert main(["--actors", "2", "--rows", "64", "--jobs", "1", "--modes", "static",
                 "--preset", "a100-qwen0.5b", "--max-num-seqs", "48",
                 "--json-out", str(out_file)]) == 0
    engine = json.loads(out_file.read_text())["engine"]
    assert (engine["max_num_seqs"], engine["max_num_batched_tokens"]) == (48, 8192)


def test_static_queues_ray_data_tasks_beyond_the_running_batches() -> None:
    # Ray Data binds 2 x max_concurrent_batches batches per actor by default; only
    # max_concurrent_batches of them run, the rest wait in the actor's task queue
    wl = heavy_tail(400, seed=6)
    cost = replace(LINEAR, kv_capacity_tokens=1_000_000)
    shape = EngineShape(512, max_finishes=1)
    queued = Cluster(wl, 2, cost, shape, mode_config("static", 512, batch_size=8,
                                                      max_concurrent_batches=4))
    assert queued.mode.tasks_in_flight == 8
    peak_open, peak_running = 0, 0
    orig = queued._span_end

    def watch(*a):  # type: ignore[no-untyped-def]
        nonlocal peak_open, peak_running
        orig(*a)
        peak_open = max(peak_open, *queued.batches_open)
        peak_running = max(peak_running, *queued.batches_running)
        for i, act in enumerate(queued.actors):  # the engine sees the running batches only
            assert len(act.live) <= 8 * queued.batches_running[i]

    queued._span_end = watch  # type: ignore[method-assign]
    res = queued.run()
    assert res.rows_finished == wl.num_rows
    assert peak_open == 8 and peak_running == 4
    assert not any(queued.task_queue) and sum(queued.batches_running) == 0
    # no queue (tasks in flight = concurrent batches): the last batches are bound later
    plain = Cluster(wl, 2, cost, shape, mode_config("static", 512, batch_size=8,
                                                     max_concurrent_batches=4,
                                                     max_tasks_in_flight=4))
    assert plain.run().rows_finished == wl.num_rows
    assert np.max(queued.batch_bound_at) < np.max(plain.batch_bound_at)
    with pytest.raises(ValueError, match="max_tasks_in_flight"):
        mode_config("static", 64, max_concurrent_batches=8, max_tasks_in_flight=4)


def test_migration_bound_floor_is_below_every_simulated_schedule() -> None:
    # lab/batchgen_lab/migration_bound.py calls `packing_floor` a bound no schedule on 2 engines beats
    from batchgen_lab.migration_bound import one_actor, packing_floor

    shape = EngineShape(8, max_num_batched_tokens=2048, block_size=16, max_finishes=1)
    on_mode = ModeConfig("migrate", batch_size=16, migrate=True, tick_s=0.05,
                         placement=PlacementConfig(queue_depth=16, min_running_age=4,
                                                   min_kv_gain_tokens=8, seat_receivers=True))
    for seed in range(3):
        wl = heavy_tail(64, seed=seed)
        inp, out = wl.input_lens.tolist(), wl.output_lens.tolist()
        floor = packing_floor(inp, out, LINEAR, seats=8)
        halves = [list(range(i, 64, 2)) for i in (0, 1)]
        off = max(one_actor([inp[i] for i in h], [out[i] for i in h], LINEAR, shape)
                  for h in halves)
        on = Cluster(wl, 2, LINEAR, shape, on_mode).run().bct_s
        alone = one_actor(inp, out, LINEAR, shape)  # one engine does everything
        assert 0 < floor <= min(off, on) and off <= alone
        # the floor is the longest row alone or half the work at full batches, nothing looser
        longest = max(LINEAR.step_time(i, 0, 1) + (o - 1) * LINEAR.step_time(1, 0, 1)
                      for i, o in zip(inp, out))
        assert floor >= longest


def test_longest_first_is_the_same_rows_sorted() -> None:
    wl = make_workload("reasoning", 500, seed=1)
    lf = wl.longest_first()
    assert (np.diff(lf.output_lens) <= 0).all()
    pairs = sorted(zip(wl.output_lens.tolist(), wl.input_lens.tolist()))
    assert pairs == sorted(zip(lf.output_lens.tolist(), lf.input_lens.tolist()))
    assert lf.max_output == wl.max_output and lf.total_tokens == wl.total_tokens
