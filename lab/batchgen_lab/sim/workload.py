"""Synthetic workloads: per-row prompt length and the output length at which the row stops.

The output length plays the role of the EOS the model would sample; the engine never sees it
(its `max_tokens` stays at the workload cap), so the placement policy cannot cheat by reading it.

* `reasoning`: input ~ lognormal(mu=6.5, sigma=0.7) capped at 8192 (median 665 tokens), output ~
  lognormal(mu=6.0, sigma=1.2) capped at 16384 (median 403, mean ~830, 1% above ~6,600): long
  chains of thought with a heavy tail.
* `uniform`: input ~ U[256, 2048], output ~ U[64, 1024]: a light tail, for contrast.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WORKLOADS = ("reasoning", "uniform")


@dataclass(frozen=True)
class Workload:
    name: str
    input_lens: np.ndarray  # [rows] int
    output_lens: np.ndarray  # [rows] int, >= 1
    max_output: int  # the engine's max_tokens for every row

    @property
    def num_rows(self) -> int:
        return len(self.input_lens)

    def longest_first(self) -> "Workload":
        """The same rows ordered by output length, longest first (ties keep their order): an
        oracle ordering, since no real job knows its output lengths in advance."""
        order = np.argsort(-self.output_lens, kind="stable")
        return Workload(self.name + "-longest-first", self.input_lens[order],
                        self.output_lens[order], self.max_output)

    @property
    def total_tokens(self) -> int:
        return int(self.input_lens.sum() + self.output_lens.sum())


def make_workload(name: str, rows: int, seed: int = 0) -> Workload:
    if rows < 1:
        raise ValueError(f"rows={rows!r}: must be >= 1")
    rng = np.random.default_rng(seed)
    if name == "reasoning":
        inp = np.minimum(rng.lognormal(6.5, 0.7, rows), 8192)
        out = np.minimum(rng.lognormal(6.0, 1.2, rows), 16384)
        cap = 16384
    elif name == "uniform":
        inp = rng.integers(256, 2049, rows)
        out = rng.integers(64, 1025, rows)
        cap = 1024
    else:
        raise ValueError(f"unknown workload {name!r}; valid: {WORKLOADS}")
    inp = np.maximum(np.rint(inp), 1).astype(np.int64)
    out = np.maximum(np.rint(out), 1).astype(np.int64)
    return Workload(name, inp, out, cap)
