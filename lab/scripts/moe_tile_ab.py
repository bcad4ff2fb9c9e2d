"""Interleaved A/B of an MoE decode step across kernel revisions, in one engine.

One engine of `moe_throughput.py`'s model (random Qwen3-MoE shape: 8 layers, hidden 512, 32
experts of 256, top-4, tied 49k vocabulary, fp32) decodes B sequences; each decode step runs
under one arm, the arms taking turns step by step (order rotated each round), so a machine whose
load changes slows every arm alike. Arms:
  before  the C kernels built from `--baseline-rev`'s sources (default: before the AVX2 tile
          change), the q|k|v, o and router matmuls on oneDNN's packed weights
  tile    this tree's C kernels, the projections still on oneDNN
  rows    this tree's C kernels, the projections through the AVX2 row kernel on the plain
          weight (the "rows" layout the backend now picks on an AVX2 CPU without AVX-512)
  mkl     this tree's C kernels, the projections through F.linear (MKL) on the plain weight
The oneDNN arms need a packed copy of each projection next to the plain one: this benchmark
holds two copies, the engine never does. Reported per B: median wall and process CPU time per
step, the p10-p90 spread of wall, and each arm's speed-up over `before` (ratio of medians).
Needs an AVX2 CPU without AVX-512 (elsewhere the projections live in panels).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python lab/scripts/moe_tile_ab.py --batches 1,8,16,32
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python lab/scripts/moe_tile_ab.py --model default  # dense

Prints a table, then one JSON line.
"""
from __future__ import annotations

import ctypes
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]),  # lab/: batchgen_lab
                str(Path(__file__).resolve().parents[2] / "benchmarks")]
from _common import make_workload, step_until_decode  # noqa: E402
from batchgen_lab.ab import interleaved_steps  # noqa: E402
from cpu_throughput import FIRST_PLAIN_ID, VOCAB_SIZE  # noqa: E402
from moe_throughput import moe_model_dir, print_step_records, step_bench_parser  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ARMS = ("before", "tile", "rows", "mkl")


def baseline_library(rev: str) -> ctypes.CDLL:
    """The kernel library built from the csrc/ files of git revision `rev`."""
    from batchgen_data.kernels.cpu import build

    csrc = "kernels/cpu/csrc"
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:{csrc}"],
                           check=True, capture_output=True, text=True).stdout.split()
    tmp = Path(tempfile.mkdtemp(prefix="moe_tile_ab."))
    for name in names:
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{csrc}/{name}"],
                              check=True, capture_output=True, text=True).stdout
        (tmp / name).write_text(text)
    out = tmp / "baseline.so"
    subprocess.run(["cc", *build.FLAGS, *map(str, sorted(tmp.glob("*.c"))), "-o", str(out),
                    "-lm"], check=True, capture_output=True, text=True, timeout=120)
    lib = ctypes.CDLL(str(out))
    build._declare(lib)
    return lib


def run_batch(model_dir: Path | str, batch: int, rounds: int, seed: int, old: ctypes.CDLL
              ) -> list[dict]:
    from batchgen_data import LLM, SamplingParams
    from batchgen_data.kernels.cpu import build
    from batchgen_data.kernels.cpu import linear as cpu_linear
    from batchgen_data.layers.linear import Linear

    llm = LLM(model=str(model_dir), dtype="float32", max_num_seqs=batch,
              max_num_batched_tokens=2048, enable_prefix_caching=False)
    eng, model = llm.engine, llm.engine.runner.model
    projections = [m for m in model.modules() if isinstance(m, Linear)]
    if not projections or any(m.layout != "rows" for m in projections):
        raise SystemExit("the projections are not on the rows layout here (AVX-512, no AVX2, "
                         "or no compiler)")
    # the oneDNN arms' copy (benchmark only)
    onednn = {m: cpu_linear.pack_onednn(m.weight.detach()) for m in projections}
    real_library = build.library
    new = real_library()

    def set_arm(name: str) -> None:
        lib = old if name == "before" else new
        build.library = lambda: lib  # every kernel wrapper looks the library up per call
        for m in projections:
            m.layout = {"rows": "rows", "mkl": "plain"}.get(name, "onednn")
            m.packed = onednn[m] if m.layout == "onednn" else None

    for r in make_workload("uniform", batch, seed, VOCAB_SIZE, FIRST_PLAIN_ID):
        eng.submit(r.prompt_token_ids, SamplingParams(max_tokens=rounds * len(ARMS) + 8,
                                                      ignore_eos=True, temperature=0))
    step_until_decode(eng)
    try:
        return interleaved_steps(eng.step, set_arm, list(ARMS), rounds, batch, base="before")
    finally:
        set_arm("rows")
        build.library = real_library


def main(argv: list[str] | None = None) -> None:
    ap = step_bench_parser(__doc__)
    ap.add_argument("--model", default=None,
                    help="another model directory, or `default` (the dense default model); "
                         "default: the random Qwen3-MoE model")
    ap.add_argument("--baseline-rev", default="c07b472",
                    help="git revision whose kernels the `before` arm runs")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    old = baseline_library(args.baseline_rev)
    if args.model == "default":
        from batchgen_data.models.default_model import default_model_dir
        args.model = str(default_model_dir())
    model_dir = args.model or moe_model_dir(args.seed)
    records = []
    for batch in (int(b) for b in args.batches.split(",")):
        records += run_batch(model_dir, batch, args.rounds, args.seed, old)
        print(f"B={batch} done", file=sys.stderr, flush=True)
    print_step_records("moe_tile_ab", records, ["batch", "arm", "wall_ms", "p10_ms", "p90_ms",
                                                "cpu_ms", "speedup"],
                       threads=args.threads, rounds=args.rounds, baseline_rev=args.baseline_rev)

if __name__ == "__main__":
    main()
