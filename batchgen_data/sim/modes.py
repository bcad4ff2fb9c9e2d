"""The three ways of feeding actors that the simulator compares.

* `static` — ray.data.llm today: rows are cut into input batches of `batch_size` (default 32,
  `vLLMEngineProcessorConfig.batch_size`); an actor runs at most `max_concurrent_batches` (8) of
  them at once (the actor's Ray Core `max_concurrency`) and a batch returns when its slowest row
  is done. Ray Data keeps up to `max_tasks_in_flight` batches bound to each actor: by default
  2 x `max_concurrent_batches` (ray/llm/_internal/batch/processor/vllm_engine_proc.py passes
  `max_tasks_in_flight_per_actor` to `ActorPoolStrategy`; unset, Ray Data 2.60 uses
  `DEFAULT_ACTOR_MAX_TASKS_IN_FLIGHT_TO_MAX_CONCURRENCY_FACTOR` = 2). The bound batches beyond
  the running ones wait in the actor's task queue, unseen by its engine, and start in order as
  running batches return; a new batch goes to the actor with the fewest batches in flight.
* `continuous` — this project's connector without migration: input batches stream in whenever
  fewer than `max_num_seqs + queue_depth` rows are unfinished (the connector's default window is
  2 x max_num_seqs), finished rows stream out, and every row stays on the actor it was bound to.
* `migrate` — the same streaming, with late binding (a shallow queue of one input batch beyond
  the seats) and the placement policy moving work between actors every `tick_s`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from batchgen_data.placement import PlacementConfig

MODES = ("static", "continuous", "migrate")


@dataclass(frozen=True, slots=True)
class ModeConfig:
    name: str
    batch_size: int = 32
    max_concurrent_batches: int = 8  # static only
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    migrate: bool = False
    tick_s: float = 0.25  # coordinator period (migrate only)
    rpc_latency_s: float = 2e-3  # one coordinator round trip / one moved request's control data
    max_donors: int = 16  # donors the coordinator asks for request summaries per round
    max_tasks_in_flight: int | None = None  # static only; None: 2 x max_concurrent_batches

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
        """Input batches Ray Data binds to one actor at a time (static mode)."""
        return self.max_tasks_in_flight or 2 * self.max_concurrent_batches

    @property
    def static(self) -> bool:
        return self.name == "static"


def mode_config(name: str, max_num_seqs: int, batch_size: int = 32,
                max_concurrent_batches: int = 8, tick_s: float = 0.25,
                placement: PlacementConfig | None = None,
                max_tasks_in_flight: int | None = None) -> ModeConfig:
    """The defaults used for the headline comparison."""
    if name == "continuous":
        pcfg = PlacementConfig(queue_depth=max_num_seqs)  # the connector's 2 x max_num_seqs window
    else:
        pcfg = placement or PlacementConfig(queue_depth=batch_size)
    return ModeConfig(name, batch_size, max_concurrent_batches, pcfg, name == "migrate", tick_s,
                      max_tasks_in_flight=max_tasks_in_flight)
