"""Engine and connector statistics of a Ray job: `ray.util.metrics`, and the run report.

Each `BatchGenPredictor` actor starts one `StatsExport`. After engine steps (at most every
`interval_s`) it sets Ray metrics tagged with the actor — they reach Prometheus and the Ray
dashboard like any Ray application metric:

    batchgen_sequences{state=waiting|running|held}   gauge
    batchgen_kv_cache_usage, batchgen_prefix_cache_hit_rate, batchgen_preemptions   gauges
    batchgen_generated_tokens, batchgen_computed_tokens, batchgen_finished_requests,
    batchgen_migrations{direction=exported|imported}   counters
    batchgen_tokens_per_expert{stat=...}   gauge, for an MoE model whose engine reports it

When the job keeps a run report (the command's `--report`, or `RunCollector.start(job_id)` in a
Python job) the same samples, and the migrations, also go to the job's `RunCollector` actor,
from which the driver builds the HTML report (`report.html.write_html`).
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

from batchgen_data.report.record import EngineSampler, RunRecord

log = logging.getLogger(__name__)


def collector_name(job_id: str) -> str:
    return f"batchgen-report-{job_id}"


class RunCollector:
    """A Ray actor that gathers every engine's part of the run record (`RunRecord.to_part`)."""

    def __init__(self) -> None:
        self.record = RunRecord()

    def add(self, part: dict[str, Any]) -> None:
        self.record.merge(part)

    def part(self) -> dict[str, Any]:
        return self.record.to_part()

    @staticmethod
    def start(job_id: str) -> Any:
        """Create the job's collector in the driver (before the job runs); returns its handle."""
        import ray

        cls = ray.remote(num_cpus=0)(RunCollector)
        return cls.options(name=collector_name(job_id), get_if_exists=True).remote()


class StatsExport:
    """In one actor: engine step hook → Ray metrics, and record parts → the job's collector."""

    def __init__(self, driver: Any, migration: Any, job_id: str | None,
                 interval_s: float = 0.5) -> None:
        from ray.util.metrics import Counter, Gauge

        self.actor = f"{socket.gethostname()}:{os.getpid()}"
        self.migration = migration
        tags = ("actor",)
        self.seqs = Gauge("batchgen_sequences", "sequences in the engine, by state",
                          tag_keys=("actor", "state"))
        self.gauges = {name: Gauge(f"batchgen_{name}", doc, tag_keys=tags) for name, doc in (
            ("kv_cache_usage", "fraction of KV blocks in use"),
            ("prefix_cache_hit_rate", "prompt blocks served from the prefix cache"),
            ("preemptions", "running sequences held for memory so far"))}
        self.counters = {name: Counter(f"batchgen_{name}", doc, tag_keys=tags) for name, doc in (
            ("generated_tokens", "tokens sampled"),
            ("computed_tokens", "tokens run through the model"),
            ("finished_requests", "requests finished"))}
        self.moves = Counter("batchgen_migrations", "requests moved between engines",
                             tag_keys=("actor", "direction"))
        self.experts = Gauge("batchgen_tokens_per_expert", "tokens routed to one expert per step",
                             tag_keys=("actor", "stat"))
        self._last: dict[str, int] = {}
        self._last_t = float("-inf")
        self.interval_s = interval_s
        self.wait_s = 10.0  # a flush that waits gives up (and stops reporting) after this
        self.record = RunRecord()
        self.sampler = EngineSampler(self.record, self.actor, interval_s / 2)
        self.collector = _find_collector(job_id)
        self._stop = threading.Event()
        driver.step_hooks.append(self.on_step)
        if self.collector is not None:
            threading.Thread(target=self._ship_loop, name="batchgen-stats", daemon=True).start()

    def on_step(self, engine: Any) -> None:
        """Engine thread, after a step: the only place engine state is read, so no races."""
        if self.collector is not None:
            self.sampler(engine)
        now = time.monotonic()
        if now - self._last_t < self.interval_s:
            return
        self._last_t = now
        tags = {"actor": self.actor}
        load = engine.load()
        for state in ("waiting", "running", "held"):
            self.seqs.set(getattr(load, state), tags={**tags, "state": state})
        st = engine.stats
        self.gauges["kv_cache_usage"].set(1 - load.free_blocks / max(load.total_blocks, 1), tags)
        pool = engine.pool
        self.gauges["prefix_cache_hit_rate"].set(pool.hits / pool.queries if pool.queries else 0,
                                                 tags)
        self.gauges["preemptions"].set(st.num_preemptions, tags)
        for name, value in (("generated_tokens", st.generated_tokens),
                            ("computed_tokens", st.computed_tokens),
                            ("finished_requests", st.num_finished)):
            self._add(self.counters[name], name, value, tags)
        experts = getattr(st, "tokens_per_expert", None)  # MoE engines only
        if isinstance(experts, dict):
            for stat, value in experts.items():
                if isinstance(value, (int, float)):
                    self.experts.set(value, tags={**tags, "stat": str(stat)})
        counts = self.migration.counts if self.migration is not None else {}
        for direction in ("exported", "imported"):
            before = self._last.get(direction, 0)
            if self._add(self.moves, direction, counts.get(direction, 0),
                         {**tags, "direction": direction}) and self.collector is not None:
                kind = "export" if direction == "exported" else "import"
                for _ in range(counts.get(direction, 0) - before):
                    self.record.add_migration(time.time(), self.actor, kind)

    def _add(self, counter: Any, key: str, total: int, tags: dict[str, str]) -> bool:
        """Counters take increments; the engine keeps totals."""
        delta = total - self._last.get(key, 0)
        if delta > 0:
            counter.inc(delta, tags)
            self._last[key] = total
        return delta > 0

    def _ship_loop(self) -> None:
        while not self._stop.wait(1.0):
            self.flush()

    def flush(self, wait: bool = False) -> None:
        """Ship the samples taken since the last flush. `wait`: until the collector has them
        (the predictor does so before each yield, so that once the driver holds every row,
        the collector holds every sample; a yield with nothing new costs nothing)."""
        part = self.record.drain()
        if (part["samples"] or part["migrations"]) and self.collector is not None:
            try:
                ref = self.collector.add.remote(part)
                if wait:
                    import ray

                    ray.get(ref, timeout=self.wait_s)
            except Exception as e:  # noqa: BLE001 - the report is a side product: never fail rows
                log.warning("batchgen: run report collector unreachable (%r)", e)
                self.collector = None

    def stop(self) -> None:
        self._stop.set()
        self.flush()


def _find_collector(job_id: str | None) -> Any:
    if job_id is None:
        return None
    import ray

    try:
        return ray.get_actor(collector_name(job_id))
    except ValueError:  # the job keeps no report
        return None


def start_stats_export(driver: Any, migration: Any, job_id: str | None) -> StatsExport | None:
    """A StatsExport for this actor; None (logged) when Ray metrics are unavailable."""
    try:
        return StatsExport(driver, migration, job_id)
    except Exception as e:  # noqa: BLE001 - statistics must never stop an actor from serving
        log.warning("batchgen: no Ray metrics for this actor (%r)", e)
        return None
