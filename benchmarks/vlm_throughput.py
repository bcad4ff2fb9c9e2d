"""Rows with images on the CPU: this engine against Hugging Face `generate`, side by side.

A Qwen2.5-VL-shaped model with random weights (fp32, `--size tiny | small`), saved once with its
HF processor, and `--rows` chat rows holding 1-2 JPEG images each as `data:` URLs, a share
(`--repeat-share`, 0.3) of the image slots drawn from a few repeated pictures (a logo, a page
template). Every system decodes the same JPEG bytes and runs exactly `--max-tokens` greedy
tokens per row (EOS ignored); the metric is output tokens per second over the wall time of the
whole job, preprocessing included (model loading excluded).

  ours-threads  rows prepared on the inputs pipeline's worker threads (`ImagePreparer`, all
                rows handed to it at once) while this thread steps the engine and submits each
                row as it becomes ready: what the front doors do
  ours-inline   the same engine, but every row prepared on the stepping thread, one after
                another, before the first step (as `LLM.chat` and vLLM's offline `LLM` do):
                the engine waits for every JPEG
  hf            HF `model.generate` on left-padded batches of `--hf-batch` rows, each batch's
                images through the HF processor's call (its docs' batched generation)

Per system: the engine's idle share (1 - time in `Engine.step` / wall time), the encoder
cache's hits and images encoded (`engine.encoder_cache`), and the tower time the hits saved
(hits x the HF tower's mean time per image, measured here). `agree_vs_hf`: the share of rows
whose tokens equal HF's (padded fp32 batches may differ from unpadded runs on near-ties).

    .venv/bin/python benchmarks/vlm_throughput.py --rows 200 --repeats 3
    .venv/bin/python benchmarks/vlm_throughput.py --rows 8 --max-tokens 4 --repeats 1  # smoke
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _vlm_model import QUESTIONS, build_model  # noqa: E402

SYSTEMS = ("ours-threads", "ours-inline", "hf")


def make_rows(n: int, repeat_share: float, seed: int = 0) -> list[list[bytes]]:
    """`n` rows of 1-2 JPEG images; `repeat_share` of the image slots from 6 repeated ones."""
    from PIL import Image

    rng = np.random.default_rng(seed)

    def jpeg(k: int) -> bytes:
        r = np.random.default_rng(k)
        w, h = int(r.choice([112, 168, 224])), int(r.choice([112, 168, 224]))
        base = r.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
        big = np.kron(base, np.ones((8, 8, 1), np.uint8))[:h, :w]
        buf = io.BytesIO()
        Image.fromarray(big).save(buf, format="JPEG", quality=90)
        return buf.getvalue()

    repeated = [jpeg(10_000 + k) for k in range(6)]
    rows, fresh = [], 0
    for _ in range(n):
        imgs = []
        for _ in range(int(rng.integers(1, 3))):
            if rng.random() < repeat_share:
                imgs.append(repeated[int(rng.integers(len(repeated)))])
            else:
                fresh += 1
                imgs.append(jpeg(fresh))
        rows.append(imgs)
    return rows


def messages(i: int, imgs: list[bytes]) -> list[dict[str, Any]]:
    parts = [{"type": "image_url", "image_url": {
        "url": "data:image/jpeg;base64," + base64.b64encode(b).decode()}} for b in imgs]
    return [{"role": "user", "content": [*parts,
                                         {"type": "text", "text": QUESTIONS[i % len(QUESTIONS)]}]}]


def run_ours(model_dir: str, rows: list[list[bytes]], max_tokens: int, inline: bool,
             workers: int, device: str) -> dict[str, Any]:
    from batchgen_data.engine.engine import Engine
    from batchgen_data.inputs.image_options import ImageOptions
    from batchgen_data.inputs.images import ImagePreparer
    from batchgen_data.sampling_params import SamplingParams

    engine = Engine.from_kwargs(model_dir, dtype="float32", max_num_seqs=64, device=device)
    prep = ImagePreparer.for_model(model_dir, ImageOptions(image_workers=workers))
    assert prep is not None, "the model directory has no image processor"
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    convs = [messages(i, imgs) for i, imgs in enumerate(rows)]
    tokens: dict[str, list[int]] = {}
    order: dict[str, int] = {}
    step_s = 0.0
    t0 = time.perf_counter()
    pending = [] if inline else [prep.submit_chat(c) for c in convs]
    waiting = set(range(len(pending)))

    def submit(i: int, ready: Any) -> None:
        rid = engine.submit(ready.prompt_token_ids, sp, prompt=ready.prompt,
                            mm_inputs=list(ready.images))
        order[rid] = i

    if inline:  # every row prepared on this thread before the first step, one at a time
        for i, c in enumerate(convs):
            submit(i, prep.prepare_chat(c))
    while len(tokens) < len(rows):
        if not inline:  # every row whose preparation finished, in whatever order
            ready = [i for i in waiting if pending[i].done()]
            for i in ready:
                submit(i, pending[i].result())
            waiting.difference_update(ready)
        if engine.has_unfinished():
            s = time.perf_counter()
            outs = engine.step()
            step_s += time.perf_counter() - s
            for out in outs:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        else:
            time.sleep(0.0005)  # nothing ready: the engine is idle
    wall = time.perf_counter() - t0
    cache = getattr(engine, "encoder_cache", None)
    result = {"wall_s": wall, "idle_share": 1.0 - step_s / wall,
              "tokens": [tokens[r] for r in sorted(order, key=order.get)],
              "cache_hits": getattr(cache, "hits", None),
              "encoded": getattr(cache, "encoded", None),
              "prep_busy_s": prep.busy_s}
    prep.close()
    engine.close()
    return result


def run_hf(model_dir: str, rows: list[list[bytes]], max_tokens: int, batch: int,
           device: str) -> dict[str, Any]:
    from PIL import Image
    from transformers import Qwen2_5_VLForConditionalGeneration

    from batchgen_data.inputs.hf_processor import load_processor

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    model.to(device).eval()
    proc = load_processor(model_dir)  # AutoProcessor's, without torchvision's video part
    proc.tokenizer.padding_side = "left"
    out_tokens: list[list[int]] = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(rows), batch):
            chunk = rows[b:b + batch]
            texts = [proc.apply_chat_template(
                [{"role": "user", "content": [*({"type": "image"} for _ in imgs),
                                              {"type": "text", "text": QUESTIONS[(b + j) %
                                                                             len(QUESTIONS)]}]}],
                tokenize=False, add_generation_prompt=True) for j, imgs in enumerate(chunk)]
            images = [Image.open(io.BytesIO(x)).convert("RGB") for imgs in chunk for x in imgs]
            inputs = proc(text=texts, images=images, padding=True,
                          return_tensors="pt").to(device)
            gen = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False)
            width = inputs["input_ids"].shape[1]
            out_tokens.extend(g[width:].tolist() for g in gen)
        wall = time.perf_counter() - t0
        one = proc(text=["<|vision_start|><|image_pad|><|vision_end|>"],
                   images=[Image.open(io.BytesIO(rows[0][0])).convert("RGB")],
                   return_tensors="pt").to(device)
        s = time.perf_counter()
        for _ in range(3):
            model.model.get_image_features(one["pixel_values"], one["image_grid_thw"])
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        tower_s = (time.perf_counter() - s) / 3
    return {"wall_s": wall, "tokens": out_tokens, "tower_s_per_image": tower_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeat-share", type=float, default=0.3)
    ap.add_argument("--size", choices=("tiny", "small"), default="small")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2, help="image_workers of ours-threads")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (run_gpu.sh vlm)")
    args = ap.parse_args()
    systems = [s for s in args.systems.split(",") if s]
    rows = make_rows(args.rows, args.repeat_share)
    n_images = sum(len(r) for r in rows)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_model(Path(tmp), args.size))
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
        for _ in range(args.repeats):  # systems interleaved: a load change hits them alike
            for s in systems:
                if s == "hf":
                    runs[s].append(run_hf(model_dir, rows, args.max_tokens, args.hf_batch,
                                          args.device))
                else:
                    runs[s].append(run_ours(model_dir, rows, args.max_tokens,
                                            s == "ours-inline", args.workers, args.device))
    total = args.rows * args.max_tokens
    med = {s: sorted(r, key=lambda x: x["wall_s"])[(len(r) - 1) // 2] for s, r in runs.items()}
    tower = med["hf"]["tower_s_per_image"] if "hf" in med else None
    print(f"{'system':14} {'tok/s':>9} {'vs_hf':>6} {'wall_s':>8} {'spread':>7} {'idle':>6} "
          f"{'hits':>5} {'encoded':>7} {'saved_s':>7} {'agree':>6}")
    record: dict[str, Any] = {"bench": "vlm_throughput", "rows": args.rows, "images": n_images,
                              "max_tokens": args.max_tokens, "size": args.size,
                              "repeat_share": args.repeat_share, "repeats": args.repeats,
                              "device": args.device,
                              "load_1m": round(os.getloadavg()[0], 2), "systems": {}}
    for s, m in med.items():
        walls = [r["wall_s"] for r in runs[s]]
        tok_s = total / m["wall_s"]
        vs_hf = tok_s / (total / med["hf"]["wall_s"]) if "hf" in med else None
        agree = (statistics.mean(a == b for a, b in zip(m["tokens"], med["hf"]["tokens"]))
                 if "hf" in med and s != "hf" else None)
        hits = m.get("cache_hits")
        saved = hits * tower if hits is not None and tower is not None else None
        spread = (max(walls) - min(walls)) / m["wall_s"]
        print(f"{s:14} {tok_s:9.1f} {_f(vs_hf, 6, 2)} {m['wall_s']:8.2f} {spread:7.1%} "
              f"{_f(m.get('idle_share'), 6, 3)} {_f(hits, 5, 0)} {_f(m.get('encoded'), 7, 0)} "
              f"{_f(saved, 7, 2)} {_f(agree, 6, 2)}")
        record["systems"][s] = {"tok_s": round(tok_s, 2), "wall_s": round(m["wall_s"], 3),
                                "wall_s_all": [round(w, 3) for w in walls],
                                "ratio_vs_hf": None if vs_hf is None else round(vs_hf, 3),
                                "idle_share": _r(m.get("idle_share")),
                                "cache_hits": hits, "encoded": m.get("encoded"),
                                "saved_s": _r(saved), "agree_vs_hf": _r(agree)}
    print(json.dumps(record))


def _f(v: Any, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:{width}.{digits}f}"


def _r(v: Any) -> Any:
    return None if v is None else round(float(v), 4)


if __name__ == "__main__":
    main()
