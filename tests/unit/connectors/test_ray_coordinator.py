"""The migration coordinator's planning and mail, without Ray (it is a plain class)."""
from __future__ import annotations

import time

from batchgen_data.connectors.ray_coordinator import Coordinator, coordinator_name

IDLE = {"waiting": 0, "running": 0, "held": 0, "remaining_tokens_est": 0,
        "free_blocks": 100, "total_blocks": 100}
BUSY = {**IDLE, "waiting": 6, "running": 2, "free_blocks": 90}
WAITING = [(f"r{i}", "waiting", 10, 0, 0) for i in range(6)]


def test_busy_engine_is_told_to_export_waiting_rows_to_the_idle_one() -> None:
    c = Coordinator(cooldown_s=60.0)
    assert c.exchange("idle", IDLE, 2, 16, [], [])["orders"] == []
    reply = c.exchange("busy", BUSY, 2, 16, WAITING, [])
    assert reply["live"] == ["busy", "idle"]
    [(dst, rids, ship)] = reply["orders"]
    assert dst == "idle" and len(rids) == 2 and not ship  # the receiver's two free seats
    assert set(rids) <= {f"r{i}" for i in range(6)} and "r0" not in rids  # queue head stays
    # both are cooling down: no second order while their reports are stale
    assert c.exchange("busy", BUSY, 2, 16, WAITING, [])["orders"] == []


def test_mail_is_forwarded_once_and_dropped_for_dead_engines() -> None:
    c = Coordinator(dead_after_s=0.2)
    c.exchange("a", IDLE, 2, 16, [], [])
    c.exchange("b", IDLE, 2, 16, [], [("a", ("deliver", "r1", "out"))])
    assert c.exchange("a", IDLE, 2, 16, [], [])["inbox"] == [("deliver", "r1", "out")]
    assert c.exchange("a", IDLE, 2, 16, [], [])["inbox"] == []
    time.sleep(0.3)
    reply = c.exchange("a", IDLE, 2, 16, [], [("b", ("import", "a", {}))])
    assert reply["live"] == ["a"] and "b" not in c.mail


def test_job_id_names_the_coordinator() -> None:
    assert coordinator_name("job1", "x") == coordinator_name("job1", "y") == \
        "batchgen-coordinator-job1"


def test_a_dead_engine_makes_the_actor_exit(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from batchgen_data.connectors import ray_predictor

    codes: list[int] = []
    monkeypatch.setattr(ray_predictor.os, "_exit", codes.append)
    ray_predictor.exit_if_engine_dead(SimpleNamespace(dead=None))
    assert codes == []
    ray_predictor.exit_if_engine_dead(SimpleNamespace(dead=RuntimeError("CUDA error")))
    assert codes == [1]  # Ray Data restarts the actor (max_restarts=-1) and retries its tasks


def test_an_engine_without_tasks_in_flight_gets_no_work() -> None:
    c = Coordinator()
    c.exchange("idle", {**IDLE, "accepting": False}, 2, 16, [], [])
    assert c.exchange("busy", BUSY, 2, 16, WAITING, [])["orders"] == []


def test_reply_says_whether_other_engines_still_own_rows() -> None:
    c = Coordinator()
    assert c.exchange("a", {**IDLE, "owned": 0}, 2, 16, [], [])["others_busy"] is False
    c.exchange("b", {**BUSY, "owned": 3}, 2, 16, WAITING, [])
    assert c.exchange("a", {**IDLE, "owned": 0}, 2, 16, [], [])["others_busy"] is True
    # an engine's own rows do not count
    assert c.exchange("b", {**BUSY, "owned": 3}, 2, 16, WAITING, [])["others_busy"] is False
    c.exchange("b", {**IDLE, "owned": 0}, 2, 16, [], [])
    assert c.exchange("a", {**IDLE, "owned": 0}, 2, 16, [], [])["others_busy"] is False


class _FakeDriver:
    """Just enough of EngineDriver for MigrationClient's constructor and loop."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        sched = SimpleNamespace(max_num_seqs=2)
        self.engine = SimpleNamespace(config=SimpleNamespace(
            scheduler=sched, cache=SimpleNamespace(block_size=16)))
        self.dead = None


def _client(linger: bool) -> object:
    from batchgen_data.connectors.ray_migration import MigrationClient, MigrationOptions

    # a huge interval: the loop never ticks, the test sets what a tick would
    return MigrationClient(_FakeDriver(), None, "e1",
                           MigrationOptions(interval_s=3600.0, timeout_s=5.0, linger=linger))


def test_last_call_lingers_while_other_engines_own_rows() -> None:
    import threading

    client = _client(linger=True)
    client.enter_call()
    client.others_busy = True
    left = threading.Event()
    t = threading.Thread(target=lambda: (client.leave_call(), left.set()))
    t.start()
    assert not left.wait(0.3)  # still open: Ray Data keeps the actor as a receiver
    with client._guests_done:
        client.others_busy = False
        client._guests_done.notify_all()
    assert left.wait(2.0) and client.active_calls == 0
    client.stop()


def test_without_linger_or_when_stopped_the_last_call_leaves_at_once() -> None:
    client = _client(linger=False)
    client.enter_call()
    client.others_busy = True
    t0 = time.monotonic()
    client.leave_call()
    assert time.monotonic() - t0 < 1.0
    lingering = _client(linger=True)
    lingering.enter_call()
    lingering.others_busy = True
    lingering.stop()  # actor shutting down: nothing to wait for
    t0 = time.monotonic()
    lingering.leave_call()
    assert time.monotonic() - t0 < 1.0
    client.stop()


def test_running_moves_ship_kv_when_the_measured_prefill_is_slower() -> None:
    placement = {"min_running_age": 8, "min_kv_gain_tokens": 16}
    kv = {"kv_bytes_per_token": 46080}  # SmolLM2-135M fp32
    a = {**IDLE, "running": 3, "free_blocks": 40, **kv}
    b = {**IDLE, **kv}
    running = [(f"r{i}", "running", 320, 300, 319) for i in range(3)]

    def orders(ship_kv: bool, prefill_tok_s: int) -> list[tuple[str, tuple[str, ...], bool]]:
        c = Coordinator(placement, ship_kv=ship_kv)
        c.exchange("b", {**b, "prefill_tokens_per_s": prefill_tok_s}, 4, 16, [], [])
        return c.exchange("a", {**a, "prefill_tokens_per_s": prefill_tok_s}, 4, 16, running,
                          [])["orders"]

    [(dst, rids, ship)] = orders(True, 300)  # a CPU core: recomputing 320 tokens takes ~1 s
    assert dst == "b" and rids and ship
    [(_, _, ship)] = orders(True, 10_000_000)  # absurdly fast prefill: recompute wins
    assert not ship
    [(_, _, ship)] = orders(False, 300)  # shipping switched off
    assert not ship
    [(_, _, ship)] = orders(True, 0)  # nothing measured yet: recompute
    assert not ship



def test_stats_count_moves_and_exchanges() -> None:
    c = Coordinator(cooldown_s=60.0)
    c.exchange("idle", IDLE, 2, 16, [], [])
    c.exchange("busy", BUSY, 2, 16, WAITING, [])
    stats = c.stats()
    assert stats["num_moves"] == 2 and stats["num_exchanges"] == 2
    assert stats["engines"] == ["busy", "idle"] and stats["cpu_s"] > 0
