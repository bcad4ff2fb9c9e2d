"""The ways of feeding actors that the simulator compares; every one gets the same engine.

* `static` — ray.data.llm with its defaults: rows are cut into input batches of `batch_size`
  (32, `vLLMEngineProcessorConfig.batch_size`); an actor runs at most `max_concurrent_batches`
  (8) of them at once (the actor's Ray Core `max_concurrency`) and a batch returns when its
  slowest row is done. Ray Data keeps up to `max_tasks_in_flight` batches bound to each actor:
  by default 2 x `max_concurrent_batches` (ray/llm/_internal/batch/processor/vllm_engine_proc.py
  passes `max_tasks_in_flight_per_actor` to `ActorPoolStrategy`; unset, Ray Data 2.60 uses
  `DEFAULT_ACTOR_MAX_TASKS_IN_FLIGHT_TO_MAX_CONCURRENCY_FACTOR` = 2). The bound batches beyond
  the running ones wait in the actor's task queue, unseen by its engine, and start in order as
  running batches return; a new batch goes to the actor with the fewest batches in flight.
  With 1024 seats the engine never sees more than 32 x 8 = 256 rows: Ray's own
  `vllm_engine_stage.py` warns a user in that case to raise `max_concurrent_batches` to at least
  ceil(max_num_seqs / batch_size).
* `static-tuned` — the same, configured as that warning says: `max_concurrent_batches` =
  max(the given value, ceil(max_num_seqs / batch_size)), so whole batches can fill every seat.
* `continuous` — this project's streaming connector without the coordinator: input batches
  stream in whenever fewer than `max_num_seqs + queue_depth` rows are unfinished (a 2 x
  max_num_seqs window), finished rows stream out, every row stays on the actor it was bound to.
* `late-bind` — streaming with row-level late binding: a shallow window (one input batch beyond
  the seats) and a coordinator that may hand rows no engine has started (waiting ones) to an
  engine short of work; a row that started stays where it started.
* `migrate` — late binding plus moving started sequences (held and running, with or without
  their KV) by the placement policy of `batchgen_data.placement`, every `tick_s`.

How Ray Data 2.60 hands input batches to actors, which the static modes follow and which the
three streaming modes follow too with `ray_tasks=True` (how the Ray connector really feeds its
engines; without it they get the row-level window above, what the simulator credits):
1. One task per input block, blocks in input order. `build_processor` cuts the input into
   blocks of exactly `batch_size` rows (`repartition(..., strict=True)`), so a task is one
   batch, one UDF call. (Non-strict, Ray 2.60 left a short block per input block and the map's
   bundler, `bundle_queue/bundler.py` min rows = batch_size, made two-call tasks whose second
   call waited for the first's slowest row: the 1.3-1.5x gap of the 16-actor run.)
2. A task goes to the alive actor with the fewest tasks in flight, if that is below
   `max_tasks_in_flight_per_actor` (`_ActorPool.select_actors`, actor_pool_map_operator.py
   ~l.1060: a heap of in-flight counts, `peekitem`); the limit defaults to 2 x the actor's
   `max_concurrency` (`_create_actor_pool_config`, l.253). The connector's late-binding and
   migration arms set it to `max_concurrency`, so no batch waits unseen at a busy actor.
3. An actor runs at most `max_concurrency` (= `max_concurrent_batches`) calls at once; the
   other bound tasks wait in its queue and start in order as calls return.
4. A task returns when its batch's last row is yielded, wherever that row ran (a moved row's
   result returns through the task that received it); only then is the slot free
   (`on_task_completed`, l.1109) and the next task dispatched, by rule 2.
5. An actor that is not alive yet gets nothing: tasks go to the actors already up, each up
   to the limit (`start_at`: start-up skew).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from batchgen_data.placement import KINDS, PlacementConfig

MODES = ("static", "static-tuned", "continuous", "late-bind", "migrate")
# connectors/ray/processor.py MAX_WINDOW_BATCHES: the connector's calls per actor at most
CONNECTOR_MAX_CALLS = 128
# what the coordinator may move in each mode that has one (the others have no coordinator)
MOVABLE: dict[str, tuple[str, ...]] = {"late-bind": ("waiting",), "migrate": KINDS}


@dataclass(frozen=True, slots=True)
class ModeConfig:
    name: str
    batch_size: int = 32
    max_concurrent_batches: int = 8  # static modes only
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    migrate: bool = False  # a coordinator runs (late-bind, migrate)
    tick_s: float = 0.25  # coordinator period
    rpc_latency_s: float = 2e-3  # one coordinator round trip / one moved request's control data
    max_donors: int = 16  # donors the coordinator asks for request summaries per round
    max_tasks_in_flight: int | None = None  # task dispatch; None: 2 x max_concurrent_batches
    ray_tasks: bool = False  # streaming modes: dispatch by Ray tasks as the connector does
    # the Ray connector's protocol (connectors/ray/migration.py): engines meet the coordinator
    # only at their reports, every `tick_s`, at uncorrelated phases, so in expectation an order
    # reaches its donor tick/2 after the plan, an exported row reaches its receiver 1.5 ticks
    # after the export (the donor's next report carries it, the receiver's next one fetches
    # it), a moved row's result reaches its owner 1 tick after it finishes (the guest's next
    # report, then the owner's), and a donor and its receiver sit out 4 ticks of planning
    # (`cooldown_s` = 4 x interval_s there). False: the coordinator sees and reaches every
    # engine at once (`rpc_latency_s`), what the simulator assumed before
    mailbox: bool = False

    @property
    def order_delay_s(self) -> float:
        return self.tick_s / 2 if self.mailbox else 0.0

    @property
    def import_delay_s(self) -> float:
        return 1.5 * self.tick_s if self.mailbox else 0.0

    @property
    def deliver_delay_s(self) -> float:
        return self.tick_s if self.mailbox else 0.0

    @property
    def cooldown_s(self) -> float:
        return 4 * self.tick_s if self.mailbox else 0.0

    def __post_init__(self) -> None:
        if self.name not in MODES:
            raise ValueError(f"mode {self.name!r}: valid: {MODES}")
        if self.batch_size < 1 or self.max_concurrent_batches < 1:
            raise ValueError("batch_size and max_concurrent_batches must be >= 1")
        if self.tick_s <= 0:
            raise ValueError(f"tick_s={self.tick_s!r}: must be > 0")
        if self.max_tasks_in_flight is not None and \
                self.max_tasks_in_flight < self.max_concurrent_batches:
            raise ValueError(f"max_tasks_in_flight={self.max_tasks_in_flight!r}: must be >= "
                             f"max_concurrent_batches ({self.max_concurrent_batches})")

    @property
    def tasks_in_flight(self) -> int:
        """Input batches Ray Data binds to one actor at a time (static modes)."""
        return self.max_tasks_in_flight or 2 * self.max_concurrent_batches

    @property
    def static(self) -> bool:
        return self.name in ("static", "static-tuned")

    @property
    def by_task(self) -> bool:
        """Rows reach an engine a whole input batch (Ray task) at a time, by the rules above."""
        return self.static or self.ray_tasks

    @property
    def movable(self) -> tuple[str, ...]:
        """Request kinds the coordinator may move ("waiting" = not started on any engine)."""
        return MOVABLE.get(self.name, KINDS) if self.migrate else ()


def tuned_concurrency(max_num_seqs: int, batch_size: int, max_concurrent_batches: int = 8) -> int:
    """What Ray's vllm_engine_stage.py asks for: enough concurrent batches to fill the seats."""
    return max(max_concurrent_batches, -(-max_num_seqs // batch_size))


def mode_config(name: str, max_num_seqs: int, batch_size: int = 32,
                max_concurrent_batches: int = 8, tick_s: float = 0.25,
                placement: PlacementConfig | None = None,
                max_tasks_in_flight: int | None = None, ray_tasks: bool = False,
                window_calls: int | None = None, mailbox: bool = False) -> ModeConfig:
    """The configuration each mode gets in the comparison, at `max_num_seqs` seats;
    `ray_tasks`: the streaming modes get Ray's task dispatch as the connector runs them, not
    the row-level window: `window_calls` concurrent batches per actor (None: the connector's
    default window) and, with a coordinator, no more bound than that; `mailbox`: moves and
    results take the connector's report-to-report delays (`ModeConfig.mailbox`)."""
    if name == "static-tuned":
        max_concurrent_batches = tuned_concurrency(max_num_seqs, batch_size,
                                                   max_concurrent_batches)
        if max_tasks_in_flight is not None:
            max_tasks_in_flight = max(max_tasks_in_flight, max_concurrent_batches)
    ray_tasks = ray_tasks and name not in ("static", "static-tuned")
    if ray_tasks:  # the connector's feed; by default a 2 x max_num_seqs window of input batches
        max_concurrent_batches = window_calls or min(CONNECTOR_MAX_CALLS,
                                                     -(-2 * max_num_seqs // batch_size))
        if name in MOVABLE and max_tasks_in_flight is None:
            max_tasks_in_flight = max_concurrent_batches  # no batch queued unseen (rule 2)
    if name == "continuous":
        pcfg = PlacementConfig(queue_depth=max_num_seqs)  # the connector's 2 x max_num_seqs window
    else:
        pcfg = placement or PlacementConfig(queue_depth=batch_size)
    return ModeConfig(name, batch_size, max_concurrent_batches, pcfg,
                      name in MOVABLE, tick_s, max_tasks_in_flight=max_tasks_in_flight,
                      ray_tasks=ray_tasks, mailbox=mailbox)
