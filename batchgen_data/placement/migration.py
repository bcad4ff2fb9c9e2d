"""Placement by load: late binding and migration between engines, from load reports alone.

Pure Python with no engine or Ray imports, so the same code drives the Ray coordinator and the
cluster simulator (`batchgen_lab.sim`). Two decisions live here:

* **Late binding** (`rows_wanted`): an engine binds only a shallow queue of rows beyond its seats
  (`max_num_seqs`), so rows stay unassigned — and free to go to whichever engine runs dry first —
  for as long as possible.
* **Migration** (`plan_moves`): when an engine runs short of work (nothing waiting, few running)
  while another still has waiting rows, held sequences or many long-running ones, move work over:
  waiting rows first (free to move), then held ones (waiting for memory anyway), then the running
  sequences that have generated the most tokens. Output lengths are unknown, but under the
  heavy-tailed lengths of reasoning workloads a sequence that has run long is expected to run
  longer still, so the oldest sequences are the long tail that decides when the job ends.

Whether a moved sequence takes its KV along or recomputes it on arrival is a cost-model choice
(`TransferCost.should_ship`): shipping pays bytes over PCIe and the network, recomputing pays a
prefill of the whole context on the receiver.
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

EngineId = Hashable
KINDS = ("waiting", "held", "running")


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One engine's load report (`Engine.load()`; `SimActor.load()` in the simulator)."""

    engine_id: EngineId
    waiting: int  # sequences queued, never scheduled yet
    running: int  # sequences with KV blocks (on the device or in the KV host tier)
    held: int  # sequences held for memory + requests held by the user (`Engine.hold`)
    remaining_tokens_est: int  # pending + still-allowed output tokens of the live requests
    free_blocks: int
    total_blocks: int
    max_num_seqs: int
    block_size: int = 16
    kv_bytes_per_token: int = 0  # what shipping one token of KV costs (0: unknown)
    # measured prompt throughput, the price of recomputing KV (0: not measured yet)
    prefill_tokens_per_s: int = 0
    # the KV host tier of running sequences (`host_kv_tier_bytes`, docs/offload.md); 0: none
    free_host_blocks: int = 0
    host_blocks: int = 0
    # seconds of the fastest pure decode step this engine has run (0: none yet): its speed at
    # light load, where a straggler (throttled, shared or older device) shows as a higher floor
    # whatever its current batch; read by the speed rules of `PlacementConfig`
    decode_step_s: float = 0.0

    @property
    def num_active(self) -> int:
        return self.waiting + self.running + self.held

    @property
    def kv_tokens(self) -> int:
        """KV of the running sequences, device and host tier: what a decode step attends over
        (a host-tier sequence's attention reads its KV each step too)."""
        used = self.total_blocks - self.free_blocks + self.host_blocks - self.free_host_blocks
        return used * self.block_size

    def has_kv_room(self, fraction: float) -> bool:
        """Whether a new sequence can start: more than `fraction` of the device tier free, or
        of the host tier, where the scheduler places a sequence the device has no room for."""
        return (self.free_blocks >= fraction * self.total_blocks
                or (self.host_blocks > 0 and self.free_host_blocks >= fraction * self.host_blocks))


@dataclass(frozen=True, slots=True)
class RequestSummary:
    """What the policy needs to know about one request on a donor engine."""

    request_id: str
    kind: str  # "waiting" | "held" | "running"
    num_tokens: int  # prompt + generated so far: the context a receiver must hold
    num_output_tokens: int  # generated so far: the age that marks the long tail
    num_computed_tokens: int = 0  # tokens with KV (on device or in the host tier)
    # a waiting row's prefix keys (placement/prefix.py), for prefix affinity; () when unknown
    prefix: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"RequestSummary.kind={self.kind!r}: must be one of {KINDS}")


@dataclass(frozen=True, slots=True)
class Move:
    src: EngineId
    dst: EngineId
    kind: str
    request_ids: tuple[str, ...]
    ship_kv: bool = False  # export with KV (True) or let the receiver recompute it (False)


@dataclass(frozen=True, slots=True)
class TransferCost:
    """Ship-or-recompute cost model for moving a sequence's KV between engines.

    ship      = latency + tokens * bytes_per_token * (1/pcie + 1/link)  (device->host at the
                sender, over the network; the receiver's host->device copy is charged there)
    recompute = tokens / prefill_tokens_per_s                          (a prefill on arrival)
    Both grow linearly, so shipping wins above a break-even length whenever its per-token cost
    is lower: for an 8B model (128 KiB/token) over 25 GB/s that is ~10 us/token against ~30 us
    of prefill on an H200; over 1.25 GB/s (10 GbE) recompute wins at every length.
    """

    bytes_per_token: int
    link_bytes_per_s: float
    pcie_bytes_per_s: float
    prefill_tokens_per_s: float
    latency_s: float = 2e-3  # per shipped request: RPC and object-store round trip

    def __post_init__(self) -> None:
        for name in ("bytes_per_token", "link_bytes_per_s", "pcie_bytes_per_s",
                     "prefill_tokens_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TransferCost.{name}={getattr(self, name)!r}: must be > 0")

    def ship_seconds(self, num_tokens: int) -> float:
        per_byte = 1.0 / self.pcie_bytes_per_s + 1.0 / self.link_bytes_per_s
        return self.latency_s + num_tokens * self.bytes_per_token * per_byte

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def should_ship(self, num_tokens: int) -> bool:
        return num_tokens > 0 and self.ship_seconds(num_tokens) < self.recompute_seconds(num_tokens)


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    # an engine is short of work when nothing waits and fewer than this share of seats is busy
    starve_fraction: float = 0.5
    # late binding: rows an engine may hold beyond its seats (about one input batch)
    queue_depth: int = 32
    # running sequences move only once they have generated this many tokens
    min_running_age: int = 256
    # ... and only when the move lowers the larger KV load of the pair by at least this much
    min_kv_gain_tokens: int = 1024
    # an engine with less than this share of KV blocks free counts all its waiting as surplus
    memory_tight_fraction: float = 0.02
    max_requests_per_receiver: int = 64  # per planning round
    # queued work (waiting, held) may also go to an engine that is not short of work but has
    # no queue, a free seat and KV memory that is not tight: a queued row gains nothing from
    # waiting where it is while a seat elsewhere is empty. Running sequences still move only
    # to engines short of work (a move costs a recompute or a KV transfer).
    seat_receivers: bool = False
    # speed rules, from each engine's measured decode-step floor (`EngineLoad.decode_step_s`):
    # a running sequence never moves to an engine whose floor is more than this many times its
    # donor's (the long tail must not land on a straggler, where every token costs more); above
    # 1 so that timing noise between equal devices blocks nothing (0: off)
    max_receiver_slowdown: float = 0.0
    # an engine whose floor is at least this many times a short-of-work receiver's hands that
    # receiver its oldest running sequences even when the KV-gain rule would keep them: a
    # lone long row on a straggler finishes sooner on a faster idle engine (0: off)
    shed_slow_factor: float = 0.0
    transfer: TransferCost | None = field(default=None)  # None: never ship KV, recompute

    def __post_init__(self) -> None:
        if not 0.0 < self.starve_fraction <= 1.0:
            raise ValueError(f"starve_fraction={self.starve_fraction!r}: must be in (0, 1]")
        for name in ("queue_depth", "min_running_age", "min_kv_gain_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be >= 0")
        if self.max_receiver_slowdown != 0.0 and self.max_receiver_slowdown < 1.0:
            raise ValueError(f"max_receiver_slowdown={self.max_receiver_slowdown!r}: must be "
                             "0 (off) or >= 1")
        if self.shed_slow_factor != 0.0 and self.shed_slow_factor <= 1.0:
            raise ValueError(f"shed_slow_factor={self.shed_slow_factor!r}: must be 0 (off) "
                             "or > 1")
        if self.max_requests_per_receiver < 1:
            raise ValueError(f"max_requests_per_receiver={self.max_requests_per_receiver!r}: "
                             "must be >= 1")


def rows_wanted(num_in_flight: int, max_num_seqs: int, cfg: PlacementConfig) -> int:
    """Late binding: how many more rows an engine should take now (0 = keep them unassigned)."""
    return max(0, max_num_seqs + cfg.queue_depth - num_in_flight)


def is_short_of_work(load: EngineLoad, cfg: PlacementConfig) -> bool:
    return load.waiting == 0 and load.held == 0 and (
        load.running < cfg.starve_fraction * load.max_num_seqs)


def _surplus_waiting(load: EngineLoad, cfg: PlacementConfig) -> int:
    """Waiting rows the engine cannot seat at its next step."""
    if not load.has_kv_room(cfg.memory_tight_fraction):
        return load.waiting
    return max(0, load.waiting - max(0, load.max_num_seqs - load.running))


def has_free_seat(load: EngineLoad, cfg: PlacementConfig) -> bool:
    """Nothing queued, a seat free and KV memory to start a row in."""
    return (load.waiting == 0 and load.held == 0 and load.running < load.max_num_seqs
            and load.has_kv_room(cfg.memory_tight_fraction))


def find_receivers(loads: Sequence[EngineLoad], cfg: PlacementConfig) -> list[EngineLoad]:
    """Engines that can take work now (short of work, or with `seat_receivers` a free seat),
    emptiest first."""
    short = [ld for ld in loads if is_short_of_work(ld, cfg)
             or (cfg.seat_receivers and has_free_seat(ld, cfg))]
    return sorted(short, key=lambda ld: (ld.num_active, str(ld.engine_id)))


def pick_donors(loads: Sequence[EngineLoad], cfg: PlacementConfig) -> list[EngineLoad]:
    """Engines worth asking for request summaries; empty when no engine is short of work.

    A donor has surplus waiting rows, held sequences, or more KV in use than the emptiest
    receiver by enough for a running sequence to be worth moving. Short engines can donate too:
    late in a job every engine is short, and the long tail still has to spread out. Fullest
    first; the caller may ask only the first few.
    """
    receivers = find_receivers(loads, cfg)
    if not receivers:
        return []
    starving = [r for r in receivers if is_short_of_work(r, cfg)]
    floor = min(r.kv_tokens for r in starving) if starving else None  # running goes to these
    donors = [ld for ld in loads
              if _surplus_waiting(ld, cfg) > 0 or ld.held > 0
              or (floor is not None and ld.running > 0
                  and ld.kv_tokens - floor >= 2 * cfg.min_kv_gain_tokens)
              or (ld.running > 0 and any(_sheds_to(ld, r, cfg) for r in starving))]
    return sorted(donors, key=lambda ld: (-ld.kv_tokens, -ld.num_active, str(ld.engine_id)))


def plan_moves(loads: Sequence[EngineLoad],
               summaries: Mapping[EngineId, Sequence[RequestSummary]],
               cfg: PlacementConfig) -> list[Move]:
    """Moves that feed the engines short of work from the donors' surplus.

    `summaries` maps donor engine ids (usually those from `pick_donors`) to their requests, with
    waiting ones in queue order. Queued work moves first — waiting rows from the back of the
    queue, then held sequences — into the emptiest receivers' free seats. Then the long tail
    spreads out: the oldest running sequence of the engine with the most KV in use goes to the
    receiver with the least, one at a time, while that lowers the larger load of the pair by at
    least `min_kv_gain_tokens`. A memory-bound decode step's time grows with the KV it reads, so
    this evens out step times, and every move lowers the sum of squared loads: later rounds
    cannot send a sequence back. An engine either gives or takes in one round, never both.
    With the speed rules on (`max_receiver_slowdown`, `shed_slow_factor`), a running sequence
    skips receivers measured that much slower than its donor, a straggler sheds its oldest to
    a receiver that much faster, and every donor-receiver pair is tried (fullest donor,
    emptiest receiver first), not only the fullest with the emptiest, which may be a straggler.
    """
    receivers = find_receivers(loads, cfg)
    if not receivers:
        return []
    by_id = {ld.engine_id: ld for ld in loads}
    kv = {ld.engine_id: ld.kv_tokens for ld in loads}
    budget = {r.engine_id: min(cfg.max_requests_per_receiver, r.max_num_seqs - r.num_active)
              for r in receivers}
    pools = {eid: _candidates(by_id[eid], reqs, cfg) for eid, reqs in summaries.items()
             if eid in by_id}
    gave: set[EngineId] = set()
    took: set[EngineId] = set()
    planned: dict[tuple[EngineId, EngineId, str, bool], list[str]] = {}

    def claim(src: EngineId, dst: EngineId, kind: str, req: RequestSummary) -> None:
        pools[src][kind].remove(req)
        ship = (kind != "waiting" and cfg.transfer is not None
                and cfg.transfer.should_ship(req.num_computed_tokens))
        planned.setdefault((src, dst, kind, ship), []).append(req.request_id)
        budget[dst] -= 1
        kv[src] -= req.num_tokens
        kv[dst] += req.num_tokens
        gave.add(src)
        took.add(dst)

    for kind in ("waiting", "held"):
        queued = sorted((e for e in pools if pools[e][kind]), key=lambda e: (-len(pools[e][kind]), str(e)))
        for r in receivers if queued else ():
            dst = r.engine_id
            for src in queued:
                while budget[dst] > 0 and pools[src][kind] and src not in took and dst not in gave:
                    claim(src, dst, kind, pools[src][kind][0])
    starving = [r.engine_id for r in receivers if is_short_of_work(r, cfg)]  # running goes here
    speed_rules = cfg.max_receiver_slowdown > 0 or cfg.shed_slow_factor > 0
    seats_left = {e: int(cfg.starve_fraction * by_id[e].max_num_seqs) - by_id[e].running
                  for e in starving}  # shed sequences fill a receiver up to short-of-work only
    while True:
        dsts = sorted((e for e in starving if budget[e] > 0 and e not in gave),
                      key=lambda e: (kv[e], str(e)))
        srcs = sorted((e for e in pools if pools[e]["running"] and e not in took),
                      key=lambda e: (kv[e], str(e)), reverse=True)
        if not speed_rules:  # without them, only the fullest donor and the emptiest receiver
            srcs, dsts = srcs[:1], dsts[:1]
        move = _first_running_move(srcs, dsts, by_id, kv, pools, seats_left, cfg)
        if move is None:
            break
        src, dst, req = move
        seats_left[dst] -= 1
        claim(src, dst, "running", req)
    return [Move(src, dst, kind, tuple(ids), ship) for (src, dst, kind, ship), ids in planned.items()]


def _first_running_move(srcs: Sequence[EngineId], dsts: Sequence[EngineId],
                        by_id: Mapping[EngineId, EngineLoad], kv: Mapping[EngineId, int],
                        pools: Mapping[EngineId, dict[str, list[RequestSummary]]],
                        seats_left: Mapping[EngineId, int], cfg: PlacementConfig,
                        ) -> tuple[EngineId, EngineId, RequestSummary] | None:
    """The first (donor, receiver, sequence) in the given orders that a rule allows."""
    for src in srcs:
        for dst in dsts:
            if src == dst or not _may_take_running(by_id[src], by_id[dst], cfg):
                continue
            shed = _sheds_to(by_id[src], by_id[dst], cfg) and seats_left[dst] > 0
            req = _running_to_move(pools[src]["running"], kv[src] - kv[dst], shed, cfg)
            if req is not None:
                return src, dst, req
    return None


def _may_take_running(src: EngineLoad, dst: EngineLoad, cfg: PlacementConfig) -> bool:
    """`max_receiver_slowdown`: a running sequence stays off an engine measured that many times
    slower than its donor (an engine not measured yet is not judged); with `shed_slow_factor`,
    off one slower by that factor."""
    if _sheds_to(dst, src, cfg):
        return False  # what shedding moved off a straggler never goes back to it
    return not (cfg.max_receiver_slowdown > 0 and src.decode_step_s > 0
                and dst.decode_step_s > cfg.max_receiver_slowdown * src.decode_step_s)


def _sheds_to(src: EngineLoad, dst: EngineLoad, cfg: PlacementConfig) -> bool:
    """`shed_slow_factor`: `src` steps at least that many times slower than `dst` (both
    measured), so its running sequences gain by moving even where the KV rule keeps them."""
    return (cfg.shed_slow_factor > 0 and src.decode_step_s > 0 and dst.decode_step_s > 0
            and src.decode_step_s >= cfg.shed_slow_factor * dst.decode_step_s)


def _running_to_move(pool: Sequence[RequestSummary], gap: int, shed: bool,
                     cfg: PlacementConfig) -> RequestSummary | None:
    """The oldest running sequence worth moving across a KV gap of `gap` tokens: one whose
    move lowers the larger load of the pair by `min_kv_gain_tokens`, or with `shed` the
    oldest of all (the speed gain pays for it)."""
    if shed and pool:
        return pool[0]
    return next((q for q in pool if min(q.num_tokens, gap - q.num_tokens)
                 >= cfg.min_kv_gain_tokens), None)


def _candidates(load: EngineLoad, reqs: Sequence[RequestSummary],
                cfg: PlacementConfig) -> dict[str, list[RequestSummary]]:
    waiting = [r for r in reqs if r.kind == "waiting"]
    surplus = min(_surplus_waiting(load, cfg), len(waiting))
    running = [r for r in reqs if r.kind == "running" and r.num_output_tokens >= cfg.min_running_age]
    running.sort(key=lambda r: (-r.num_output_tokens, r.request_id))
    return {
        "waiting": waiting[len(waiting) - surplus:][::-1],  # the head of the queue stays: it runs next
        "held": [r for r in reqs if r.kind == "held"],
        "running": running,
    }
