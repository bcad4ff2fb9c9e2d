"""The lab: research code beside the product, never installed with it.

* `batchgen_lab.sim`: the cluster simulator (the engine's real scheduler and placement policy,
  a cost model instead of the GPU) and, in its lockstep/EP half, a model of remedies this
  engine cannot run (multi-device partitioning): figures from it are models, not claims
  about batchgen_data.
* `batchgen_lab.emulated_runner`: a model runner that sleeps the cost model's step time, run
  by a real engine built from the parts it makes (``build_engine("emulated:<preset>")``).
* `batchgen_lab.ray_emulated`, `migrate_headroom`, `migration_bound`: experiments over them.
* ``lab/scripts/``: one-off A/B and diagnosis scripts (history in docs/benchmark-log.md).

Run from the repository root with ``PYTHONPATH=lab`` (the test suite sets it in pyproject's
pytest ``pythonpath``), e.g. ``PYTHONPATH=lab python -m batchgen_lab.sim --help``.
"""
