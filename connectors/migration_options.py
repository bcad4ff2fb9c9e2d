"""What a `BatchGenPredictor` may be told about cross-actor migration (`migration_options`),
and the connector's placement defaults. The mechanism is `ray_migration`; the planner is
`ray_coordinator`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchgen_data.placement import AffinityConfig

# The connector's placement switches where they differ from PlacementConfig's defaults:
# `seat_receivers`, an actor's free seat is worth filling from another actor's queue (measured
# by benchmarks/ray_migration.py)
DEFAULT_PLACEMENT: dict[str, Any] = {"seat_receivers": True}
# The speed rules, which keep the long tail off stragglers and move it off them: opt-in
# (`migration_options={"placement": SPEED_RULES}`). They read each engine's wall-clock decode
# floor, and where engines share CPU cores (2-core CI, 16 emulated actors) contention alone
# makes floors differ by more than 1.2x, so the rules blocked every move in a 2-engine job and
# made the emulated 16-actor runs invalid; they pay in the simulator (docs/ray_data.md)
SPEED_RULES: dict[str, Any] = {"max_receiver_slowdown": 1.2, "shed_slow_factor": 1.3}


@dataclass(frozen=True)
class MigrationOptions:
    job_id: str | None = None  # coordinator key; None: the Ray job id + the predictor's config
    interval_s: float = 0.25  # how often an engine reports and collects mail
    dead_after_s: float = 10.0  # an engine silent this long counts as dead
    timeout_s: float = 600.0  # an exported row not back by then is run at home again
    # ... and sooner, one the coordinator has reported lost (no live engine holds it, no mail
    # carries it) in every reply for this long
    lost_after_s: float = 10.0
    rpc_timeout_s: float = 30.0  # a coordinator call slower than this counts as a failure
    # keep an engine's last task open while other engines still own unfinished rows, so Ray
    # Data does not release it as idle (it does so once every input is dispatched) exactly
    # when the long tail could move to it; False: leave as soon as its own rows are done
    linger: bool = True
    # a moved running/held sequence takes its KV along when that is cheaper than recomputing
    # it (measured prefill rate vs bytes over `link_bytes_per_s` between nodes and
    # `pcie_bytes_per_s` device <-> host); False: always recompute
    ship_kv: bool = True
    link_bytes_per_s: float = 1.25e9  # 10 GbE
    pcie_bytes_per_s: float = 16e9  # PCIe 4.0 x16 in practice
    # PlacementConfig fields, over DEFAULT_PLACEMENT
    placement: dict[str, Any] = field(default_factory=dict)
    # what may move: queued rows (never scheduled, no KV: late binding) and started sequences
    # (running, held: migration proper). The predictor sets both from `late_binding`/`migration`
    move_queued: bool = True
    move_started: bool = True
    # late binding by prefix: a queued row moves to the engine that holds the longest match
    # of its leading blocks, else to its prefix's consistent-hash engine, with bounded loads
    # (docs/ray_data.md "How rows are placed"); `affinity`: AffinityConfig fields
    prefix_affinity: bool = True
    affinity: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("interval_s", "dead_after_s", "timeout_s", "rpc_timeout_s",
                     "lost_after_s", "link_bytes_per_s", "pcie_bytes_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"migration {name}={getattr(self, name)!r}: must be > 0")
        AffinityConfig(**self.affinity)  # its own ValueError / TypeError naming the field
