"""The migration coordinator's planning and mail, without Ray (it is a plain class)."""
from __future__ import annotations

import pickle
import time
from dataclasses import replace

from batchgen_data.connectors.ray.coordinator import Coordinator, Reply, Report, coordinator_name
from batchgen_data.placement import EngineLoad, RequestSummary

IDLE = EngineLoad("", waiting=0, running=0, held=0, remaining_tokens_est=0, free_blocks=100,
                  total_blocks=100, max_num_seqs=2, block_size=16)
BUSY = replace(IDLE, waiting=6, running=2, free_blocks=90)
WAITING = tuple(RequestSummary(f"r{i}", "waiting", 10, 0, 0) for i in range(6))


def report(engine_id: str, load: EngineLoad, movable: tuple[RequestSummary, ...] = (),
           accepting: bool = True, owned: int = 0) -> Report:
    return Report(replace(load, engine_id=engine_id), movable, accepting, owned)


def test_busy_engine_is_told_to_export_waiting_rows_to_the_idle_one() -> None:
    c = Coordinator(cooldown_s=60.0)
    assert c.exchange(report("idle", IDLE), []).orders == ()
    reply = c.exchange(report("busy", BUSY, WAITING), [])
    assert reply.live == ("busy", "idle")
    [move] = reply.orders
    assert move.src == "busy" and move.dst == "idle" and move.kind == "waiting"
    assert len(move.request_ids) == 2 and not move.ship_kv  # the receiver's two free seats
    rids = set(move.request_ids)
    assert rids <= {f"r{i}" for i in range(6)} and "r0" not in rids  # queue head stays
    # both are cooling down: no second order while their reports are stale
    assert c.exchange(report("busy", BUSY, WAITING), []).orders == ()


def test_report_and_reply_cross_process_boundaries_as_they_are() -> None:
    r = report("busy", BUSY, WAITING, owned=3)
    assert pickle.loads(pickle.dumps(r)) == r
    reply = Coordinator().exchange(r, [])
    assert isinstance(reply, Reply) and pickle.loads(pickle.dumps(reply)) == reply


def test_mail_is_forwarded_once_and_dropped_for_dead_engines() -> None:
    c = Coordinator(dead_after_s=0.2)
    c.exchange(report("a", IDLE), [])
    c.exchange(report("b", IDLE), [("a", ("deliver", "r1", "out"))])
    assert c.exchange(report("a", IDLE), []).inbox == (("deliver", "r1", "out"),)
    assert c.exchange(report("a", IDLE), []).inbox == ()
    time.sleep(0.3)
    # an import to an engine gone silent is dropped: the same reply tells its sender to
    # run the row itself
    reply = c.exchange(report("a", IDLE), [("b", ("import", "a", {}))])
    assert reply.live == ("a",) and "b" not in c.mail
    assert c.stats()["dropped_imports"] == 1 and c.stats()["pruned"] == 1


def test_a_result_waits_for_an_owner_whose_reports_stalled() -> None:
    # the owner "a" goes silent past dead_after_s while its row finishes on "b": the result
    # must still reach it when it reports again (nobody would send it a second time)
    c = Coordinator(dead_after_s=0.2)
    c.exchange(report("a", IDLE), [])
    c.exchange(report("b", IDLE), [("a", ("import", "b", {}))])  # queued for "a"
    time.sleep(0.3)
    reply = c.exchange(report("b", IDLE), [("a", ("deliver", "r1", "out"))])
    assert reply.live == ("b",)
    assert c.exchange(report("a", IDLE), []).inbox == (("import", "b", {}),
                                                       ("deliver", "r1", "out"))
    assert c.stats()["dropped_imports"] == 0


def test_job_id_names_the_coordinator() -> None:
    assert coordinator_name("job1", "x") == coordinator_name("job1", "y") == \
        "batchgen-coordinator-job1"


def test_a_dead_engine_makes_the_actor_exit(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from batchgen_data.connectors.ray import predictor as ray_predictor

    codes: list[int] = []
    monkeypatch.setattr(ray_predictor.os, "_exit", codes.append)
    ray_predictor.exit_if_engine_dead(SimpleNamespace(dead=None))
    assert codes == []
    ray_predictor.exit_if_engine_dead(SimpleNamespace(dead=RuntimeError("CUDA error")))
    assert codes == [1]  # Ray Data restarts the actor (max_restarts=-1) and retries its tasks


def test_an_engine_without_tasks_in_flight_gets_no_work() -> None:
    c = Coordinator()
    c.exchange(report("idle", IDLE, accepting=False), [])
    assert c.exchange(report("busy", BUSY, WAITING), []).orders == ()


def test_reply_says_whether_other_engines_still_own_rows() -> None:
    c = Coordinator()
    assert c.exchange(report("a", IDLE, owned=0), []).others_busy is False
    c.exchange(report("b", BUSY, WAITING, owned=3), [])
    assert c.exchange(report("a", IDLE, owned=0), []).others_busy is True
    # an engine's own rows do not count
    assert c.exchange(report("b", BUSY, WAITING, owned=3), []).others_busy is False
    c.exchange(report("b", IDLE, owned=0), [])
    assert c.exchange(report("a", IDLE, owned=0), []).others_busy is False


def test_a_lingering_engine_waits_to_hear_from_the_others_again() -> None:
    # "b" reported owning nothing, but that report may predate rows it got since (its first
    # report waits out the coordinator's start): "a", which began to linger after it, must not
    # leave on it. Once "b" has reported again, its `owned` is the verdict.
    c = Coordinator()
    c.exchange(report("b", IDLE, owned=0), [])
    c.exchange(report("a", IDLE, owned=0), [])
    lingering = replace(report("a", IDLE, owned=0), lingering=True)
    assert c.exchange(lingering, []).others_busy is True
    assert c.exchange(lingering, []).others_busy is True  # still nothing new from "b"
    c.exchange(report("b", BUSY, WAITING, owned=3), [])
    assert c.exchange(lingering, []).others_busy is True
    c.exchange(report("b", IDLE, owned=0), [])
    assert c.exchange(lingering, []).others_busy is False
    # a new stretch (a later call that lingers again) waits for a fresh report again
    c.exchange(report("a", IDLE, owned=0), [])
    assert c.exchange(lingering, []).others_busy is True


class _FakeDriver:
    """Just enough of EngineDriver for MigrationClient's constructor and loop."""

    dead = None


def _client(linger: bool) -> object:
    from batchgen_data.connectors.ray.migration import MigrationClient, MigrationOptions

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


def test_only_a_reply_to_a_lingering_report_releases_the_last_call() -> None:
    import threading

    client = _client(linger=True)
    sent: list[bool] = []
    gate = threading.Event()

    def exchange(lingering: bool = False) -> Reply:
        sent.append(lingering)
        gate.wait(5.0)
        return Reply((), (), ("e1",), others_busy=False)

    client._exchange = exchange
    client.enter_call()
    early = threading.Thread(target=client._tick)  # its report goes out before the call ends
    early.start()
    while not sent:
        time.sleep(0.01)
    left = threading.Event()
    threading.Thread(target=lambda: (client.leave_call(), left.set())).start()
    time.sleep(0.1)
    gate.set()
    early.join(5.0)
    # that reply weighed a report that did not say "lingering": it does not count
    assert sent == [False] and not left.wait(0.3)
    client._tick()
    assert sent == [False, True] and left.wait(2.0) and client.active_calls == 0
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
    b = replace(IDLE, max_num_seqs=4, kv_bytes_per_token=46080)  # SmolLM2-135M fp32
    a = replace(b, running=3, free_blocks=40)
    running = tuple(RequestSummary(f"r{i}", "running", 320, 300, 319) for i in range(3))

    def order(ship_kv: bool, prefill_tok_s: int) -> tuple[str, tuple[str, ...], bool]:
        c = Coordinator(placement, ship_kv=ship_kv)
        c.exchange(report("b", replace(b, prefill_tokens_per_s=prefill_tok_s)), [])
        [mv] = c.exchange(report("a", replace(a, prefill_tokens_per_s=prefill_tok_s), running),
                          []).orders
        return mv.dst, mv.request_ids, mv.ship_kv

    dst, rids, ship = order(True, 300)  # a CPU core: recomputing 320 tokens takes ~1 s
    assert dst == "b" and rids and ship
    assert not order(True, 10_000_000)[2]  # absurdly fast prefill: recompute wins
    assert not order(False, 300)[2]  # shipping switched off
    assert not order(True, 0)[2]  # nothing measured yet: recompute


def test_stats_count_moves_and_exchanges() -> None:
    c = Coordinator(cooldown_s=60.0)
    c.exchange(report("idle", IDLE), [])
    c.exchange(report("busy", BUSY, WAITING), [])
    stats = c.stats()
    assert stats["num_moves"] == 2 and stats["num_exchanges"] == 2
    assert stats["engines"] == ["busy", "idle"] and stats["cpu_s"] > 0


def test_a_row_no_engine_holds_and_no_mail_carries_is_reported_lost() -> None:
    c = Coordinator()
    c.exchange(report("b", IDLE), [])
    owner = replace(report("a", IDLE, owned=2), away=("r1", "r2"))
    # r1's import is on its way to b (in the outbox of this very exchange): not lost
    assert c.exchange(owner, [("b", ("import", "a", {}, "r1"))]).lost == ("r2",)
    c.exchange(replace(report("b", IDLE), guests=()), [])  # b picked r1 up, not reported yet
    assert c.exchange(owner, []).lost == ("r1", "r2")
    c.exchange(replace(report("b", IDLE), guests=("r1",)), [])  # now b runs it
    assert c.exchange(owner, []).lost == ("r2",)
    # r2's result is on its way home: not lost either
    c.exchange(replace(report("b", IDLE), guests=("r1",)), [("a", ("deliver", "r2", "out"))])
    reply = c.exchange(owner, [])
    assert reply.lost == () and reply.inbox == (("deliver", "r2", "out"),)


def test_an_owner_runs_a_row_reported_lost_for_lost_after_s(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from concurrent.futures import Future

    from batchgen_data.connectors.ray import migration as rm

    client = rm.MigrationClient(_FakeDriver(), None, "a", rm.MigrationOptions(
        interval_s=3600.0, timeout_s=600.0, lost_after_s=5.0))
    ran: list[str] = []
    monkeypatch.setattr(client, "_reclaim", lambda rid: (ran.append(rid), client.away.pop(rid)))
    clock = [100.0]
    monkeypatch.setattr(rm.time, "monotonic", lambda: clock[0])
    for rid in ("r1", "r2"):
        client.away[rid] = rm._Away({}, Future(), "b", clock[0])
    client._reclaim_lost({"a", "b"}, ("r1", "r2"))
    clock[0] += 3.0
    client._reclaim_lost({"a", "b"}, ("r1",))  # r2 turned up at b: its clock stops
    assert ran == []
    clock[0] += 3.0
    client._reclaim_lost({"a", "b"}, ("r1", "r2"))  # r2 lost again: its clock starts anew
    assert ran == ["r1"]
    clock[0] += 4.0
    client._reclaim_lost({"a", "b"}, ("r2",))
    assert ran == ["r1"]
    clock[0] += 2.0
    client._reclaim_lost({"a", "b"}, ("r2",))
    assert ran == ["r1", "r2"] and client.away == {}
    client.stop()
