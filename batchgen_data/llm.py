"""`LLM`: the offline facade (vLLM-shaped) over one engine."""
from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from tqdm.auto import tqdm

from batchgen_data.inputs.chat import render_chat
from batchgen_data.inputs.image_options import ImageOptions
from batchgen_data.inputs.image_prompts import chat_prompts, generate_prompts, mm_kwargs
from batchgen_data.inputs.images import ImagePreparer, LazyPreparer
from batchgen_data.engine import pooling_api
from batchgen_data.engine.engine import Engine
from batchgen_data.engine.pooling import PoolingEngine
from batchgen_data.engine.protocol import EngineBase, GenerationEngine
from batchgen_data.inputs.prompts import PromptType, check_priority, lora_list, params_list
from batchgen_data.lora_request import LoRARequest
from batchgen_data.outputs import RequestOutput
from batchgen_data.pooling_params import PoolingParams, PoolingRequestOutput
from batchgen_data.programs.api import Program
from batchgen_data.programs.offline import ProgramRunner
from batchgen_data.inputs.prompt_checks import check_prompt_text, first_bad_token
from batchgen_data.sampling_params import SamplingParams



class LLM:
    def __init__(self, model: str | None = None, runner: str = "auto",
                 **engine_kwargs: Any) -> None:
        """`runner` (vLLM's): "generate", "pooling" (embed / classify / score,
        docs/pooling.md), or "auto": pooling for encoders, classifiers, headless bases and
        sentence-transformers directories."""
        trust = bool(engine_kwargs.get("trust_remote_code", False))
        images = ImageOptions.pop_from(engine_kwargs)  # the inputs pipeline's (docs/multimodal.md)
        dp = engine_kwargs.pop("data_parallel_size", None)
        repartition = engine_kwargs.pop("repartition", False)
        width = engine_kwargs.pop("repartition_width", None)
        if width is not None and dp in (None, 1):
            raise ValueError(f"repartition_width={width!r}: the TP width a group of engines "
                             "joins into; it needs data_parallel_size=N >= 2")
        if pooling_api.uses_pooling(model, runner, trust, engine_kwargs.get("hf_overrides")):
            if engine_kwargs.get("enable_lora"):
                raise ValueError("enable_lora: LoRA adapters are for generation; this model "
                                 "runs as a pooling model (docs/lora.md)")
            if dp not in (None, 1) or repartition:
                raise ValueError("data_parallel_size / repartition: a pooling model runs as "
                                 "one engine (several are several LLMs, or Ray actors)")
            pooler = PoolingEngine.from_kwargs(model, **engine_kwargs)
            self._attach(pooler, pooler=pooler)
        elif dp not in (None, 1) or repartition:
            group = _engine_group(model, dp, repartition, engine_kwargs, width)
            self._attach(group, generator=group)
        else:
            engine = Engine.from_kwargs(model, **engine_kwargs)
            self._attach(engine, generator=engine, programs=engine)
        self._images = LazyPreparer(self.tokenizer, images)

    def _attach(self, engine: EngineBase, generator: GenerationEngine | None = None,
                pooler: PoolingEngine | None = None, programs: Engine | None = None) -> None:
        """The engine, and what it is known to be from how it was made: each call takes the
        one it needs without asking the engine's class (engine/protocol.py). Programs keep KV
        pinned in one engine."""
        self.engine = engine
        self._generator, self._pooler, self._programs = generator, pooler, programs
        self.tokenizer = engine.tokenizer

    @classmethod
    def _over(cls, engine: Engine, images: ImagePreparer | None = None) -> "LLM":
        """An LLM over one `Engine` built elsewhere, e.g. around a test's fake parts
        (`Engine(config, parts)`): the seam tests use instead of an engine option."""
        llm = cls.__new__(cls)
        llm._attach(engine, generator=engine, programs=engine)
        llm._images = LazyPreparer(engine.tokenizer, ready=images)
        return llm

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (vLLM's name)."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when given no sampling_params: vLLM's defaults. (vLLM reads a
        model's generation_config.json into them; this engine does not, docs/vllm-compat.md.)"""
        return SamplingParams()

    def close(self) -> None:
        """Stop the threads and processes this LLM started (overlapped steps' device thread,
        tensor-parallel ranks, a group's engines); they also stop when this process exits."""
        self.engine.close()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's name): prompts submitted later compute their
        prefixes again (benchmarks that repeat prompts). True once done."""
        return self.engine.reset_prefix_cache()

    # ---- pooling tasks (vLLM's names and outputs) ------------------------------------------
    def _pooling_engine(self, task: str) -> PoolingEngine:
        if self._pooler is None:
            raise ValueError(f"{task}: this LLM generates; start it with runner=\"pooling\" "
                             "for embed / classify / score")
        return self._pooler

    def _generation_engine(self) -> GenerationEngine:
        if self._generator is None:
            raise ValueError("this model runs as a pooling model (runner=\"pooling\"): use "
                             "embed, classify or score")
        return self._generator

    def _pool(self, prompts: Any, params: Any, task: str, use_tqdm: bool,
              truncate_prompt_tokens: int | None) -> list[PoolingRequestOutput]:
        engine = self._pooling_engine(task)
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        items = pooling_api.encode_all(lambda p: pooling_api.encode_text(self.tokenizer, p),
                                       prompts, "prompts")
        plist = pooling_api.params_list(params, len(items), truncate_prompt_tokens)
        return pooling_api.run_requests(engine, items, plist, task, use_tqdm)

    def encode(self, prompts: PromptType | Seq[PromptType],
               pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
               use_tqdm: bool = True, lora_request: Any = None,
               pooling_task: str | None = None, truncate_prompt_tokens: int | None = None
               ) -> list[PoolingRequestOutput]:
        """vLLM's pooling entry: `pooling_task` "embed" or "classify" (what `embed` and
        `classify` run); vLLM's token-level tasks are refused by name."""
        if pooling_task is None:
            raise ValueError("pooling_task required for `LLM.encode`: use LLM.embed(...) or "
                             "pooling_task=\"embed\", LLM.classify(...) or "
                             "pooling_task=\"classify\", LLM.score(...) for similarity scores")
        if pooling_task not in ("embed", "classify"):
            raise ValueError(f"pooling_task={pooling_task!r} is not supported: only \"embed\" "
                             "and \"classify\" (token_embed, token_classify and plugin tasks "
                             "are vLLM's only)")
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are for generation (docs/lora.md)")
        return self._pool(prompts, pooling_params, pooling_task, use_tqdm, truncate_prompt_tokens)

    def embed(self, prompts: PromptType | Seq[PromptType],
              pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
              use_tqdm: bool = True, truncate_prompt_tokens: int | None = None
              ) -> list[PoolingRequestOutput]:
        """One embedding per prompt (`.outputs.embedding`), in input order."""
        return self._pool(prompts, pooling_params, "embed", use_tqdm, truncate_prompt_tokens)

    def classify(self, prompts: PromptType | Seq[PromptType],
                 pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
                 use_tqdm: bool = True, truncate_prompt_tokens: int | None = None
                 ) -> list[PoolingRequestOutput]:
        """Class probabilities per prompt (`.outputs.probs`), in input order."""
        return self._pool(prompts, pooling_params, "classify", use_tqdm,
                          truncate_prompt_tokens)

    def score(self, text_1: Any, text_2: Any, pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True, truncate_prompt_tokens: int | None = None
              ) -> list[PoolingRequestOutput]:
        """vLLM's `score`: one text_1 against each text_2, or pair by pair
        (`.outputs.score`)."""
        params = pooling_params or PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)
        return pooling_api.score_pairs(self._pooling_engine("score"), text_1, text_2, params,
                                       use_tqdm)

    def _tokenize(self, prompt: PromptType, where: str) -> tuple[list[int], str | None]:
        """Bad prompts raise with the connectors' row-error message (docs/row-errors.md)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)):
                    raise TypeError(f"{where}: {first_bad_token(ids)}")
                return list(ids), prompt.get("prompt")
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"], where)
            raise ValueError(f"{where}: dict prompts need 'prompt' or 'prompt_token_ids'")
        try:
            text = check_prompt_text(prompt)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{where}: {e}") from None
        return self.tokenizer.encode(text), text

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
                 priority: int | Seq[int] | None = None) -> list[RequestOutput]:
        """Prompts reach the model as written, as in vLLM: no chat template (see `chat`).
        `lora_request`: one adapter for every prompt, or a list with one (or None) per prompt
        (needs enable_lora=True; docs/lora.md). `priority` (one, or one per prompt) is checked
        and not used: requests are served first come, first served, as vLLM's default
        scheduling policy does with it (its "priority" policy is refused here)."""
        engine = self._generation_engine()
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = generate_prompts(self._images, list(prompts))  # images: multi_modal_data
        params = params_list(sampling_params, len(prompts))
        loras = lora_list(lora_request, len(prompts))
        check_priority(priority, len(prompts))
        # validate everything before submitting anything: nothing half-runs
        encoded = [self._tokenize(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        for i, ((ids, _), sp, lr) in enumerate(zip(encoded, params, loras)):
            try:
                engine.check_request(ids, sp)
                engine.check_lora(lr)
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
        order = {}
        for i, ((ids, text), sp, lr) in enumerate(zip(encoded, params, loras)):
            order[engine.submit(ids, sp, prompt=text, lora_request=lr,
                                **mm_kwargs(prompts[i]))] = i
        return self._run(engine, order, use_tqdm)

    def chat(self, conversations: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """vLLM's `chat`: a custom Jinja `chat_template` replaces the tokenizer's, and
        `chat_template_kwargs` reach the template (e.g. `{"enable_thinking": False}`). OpenAI
        content parts with images go through the model's processor (docs/multimodal.md).
        `tools` (OpenAI's function specs) are rendered by the template's tool support; the
        engine's `tool_call_parser` reads the calls back (docs/reasoning.md)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        if tools is not None:
            chat_template_kwargs = {**(chat_template_kwargs or {}), "tools": tools}
        prompts = chat_prompts(self._images, lambda c: self.render_chat(
            c, add_generation_prompt, chat_template, chat_template_kwargs), conversations,
            add_generation_prompt, chat_template, chat_template_kwargs)
        return self.generate(prompts, sampling_params, use_tqdm)

    def run(self, rows: Seq[dict[str, Any]], program: Program,
            sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
            on_error: str = "row") -> list[dict[str, Any]]:
        """Run a `@program` on every row; its output dicts in input order.

        The steps of all rows share the engine's batches (batchgen_data/programs/offline.py).
        `sampling_params`: defaults for the fields a `Generate` leaves out. A row whose
        program fails gives `{"error": message}` (on_error="row") or raises `ProgramError`.
        """
        if self._programs is None:
            raise ValueError(f"run(program): programs need one engine (their steps keep KV "
                             f"pinned in it), not this LLM's {self.engine.kind}; start it "
                             "without data_parallel_size")
        if not isinstance(program, Program):
            raise TypeError(f"program must be a @batchgen_data.program, got "
                            f"{type(program).__name__}")
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise TypeError("sampling_params must be SamplingParams")
        rows = list(rows)
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise TypeError(f"rows[{i}] must be a dict, got {type(row).__name__}")
        runner = ProgramRunner(self._programs, program, sampling_params, on_error)
        bar = tqdm(total=len(rows), desc=f"run {program.name}", disable=not use_tqdm)
        try:
            return runner.run_all(rows, on_done=lambda: bar.update(1))
        finally:
            bar.close()

    def render_chat(self, messages: Any, add_generation_prompt: bool = True,
                    chat_template: str | None = None,
                    chat_template_kwargs: dict[str, Any] | None = None) -> tuple[list[int], str]:
        """(prompt_token_ids, text) of one conversation, as the connectors render it."""
        return render_chat(self.tokenizer, messages, add_generation_prompt, chat_template,
                           chat_template_kwargs)

    def _run(self, engine: GenerationEngine, order: dict[str, int], use_tqdm: bool
             ) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(order)
        left = len(order)
        bar = tqdm(total=left, desc="generate", disable=not use_tqdm)
        try:
            while left and engine.has_unfinished():
                for out in engine.step():
                    if out.request_id in order:
                        results[order[out.request_id]] = out
                        left -= 1
                        bar.update(1)
        except BaseException:
            # a step failed with no single request to blame (or an interrupt): this call's
            # requests leave the engine, so the next call starts clean (a request a step was
            # blamed on comes back with finish_reason "error" instead: engine/step_failure.py)
            try:
                for rid, i in order.items():
                    if results[i] is None:
                        engine.abort(rid)
            except Exception:  # noqa: BLE001 - a broken engine: the first error is the one
                pass
            raise
        finally:
            bar.close()
        return results  # type: ignore[return-value]


def _engine_group(model: str | None, dp: Any, repartition: Any,
                  engine_kwargs: dict[str, Any], width: int | None = None) -> Any:
    """`data_parallel_size=N` engines of one device each on this machine, one process each,
    as one `EngineGroup` (engine/group/group.py); `repartition` (True, or a `PartitionPolicy`)
    lets the group join them into tensor-parallel engines for a job's tail and split back
    (docs/parallel.md): one N wide, or N / k engines k wide with `repartition_width=k`."""
    from batchgen_data.engine.group.group import EngineGroup, PartitionPolicy

    size = 2 if dp is None else dp
    if not isinstance(size, int) or isinstance(size, bool) or size < 2:
        raise ValueError(f"data_parallel_size={dp!r}: an int >= 1 (with repartition, >= 2)")
    if repartition is True:
        policy: PartitionPolicy | None = PartitionPolicy()
    elif repartition is False or repartition is None:
        policy = None
    elif isinstance(repartition, PartitionPolicy):
        policy = repartition
    else:
        raise ValueError(f"repartition={repartition!r}: True, False or a PartitionPolicy")
    return EngineGroup.from_kwargs(model, size=size, policy=policy, width=width,
                                   **engine_kwargs)
