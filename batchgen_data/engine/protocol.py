"""The engines a front door drives (PEP 544), so that no front door asks which class it holds.

Two Protocols, a small base and a generation extension, because the pooling engine's requests
are not the generation engines' (`submit(token_ids, params, task, ...)` against
`submit(prompt_token_ids, sampling_params, ...)`): one Protocol would have to take the union
of both signatures, and every front door would check again what it got.

* `EngineBase`: what every engine does — `step`, `abort`, `close`, the queue's state, the
  tokenizer and `max_model_len`, `reset_prefix_cache` — and `kind`, its name in messages.
  `Engine`, `PoolingEngine` (engine/pooling.py) and `EngineGroup` (engine/group/group.py)
  implement it.
* `GenerationEngine(EngineBase)`: what the generation front doors drive — entry checks,
  `submit`, the adapters rows name, and the suspension-point primitives `export` / `import_`
  with the `load` report. `Engine` and `EngineGroup` implement it; an engine group moves its
  requests between its own engines and has no single load, so its `export`, `import_` and
  `load` raise `NotImplementedError` naming it (a program's KV pins need one engine too:
  `LLM.run` takes an `Engine` only).
tests/unit/engine/test_protocol.py checks that each class satisfies its Protocols, by
`isinstance` and by comparing signatures.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from batchgen_data.lora_request import AdapterNames, LoRARequest
from batchgen_data.placement import EngineId, EngineLoad
from batchgen_data.sampling_params import SamplingParams


@runtime_checkable
class EngineBase(Protocol):
    kind: str  # what it is called in a refusal: "generation engine", "pooling engine", ...
    tokenizer: Any
    max_model_len: int

    def step(self) -> Sequence[Any]:
        """One round of work; the requests it finished, in completion order."""
        ...

    def has_unfinished(self) -> bool:
        """Whether a request is live or an output waits for the next `step`."""
        ...

    def num_unfinished(self) -> int:
        """The live requests."""
        ...

    def abort(self, request_id: str) -> bool:
        """End a request (its output, where it has one, comes with a later `step`); False if
        it is not here."""
        ...

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's `LLM.reset_prefix_cache`); True once done."""
        ...

    def close(self) -> None:
        """Stop what the engine started (threads, ranks, engine processes)."""
        ...


@runtime_checkable
class GenerationEngine(EngineBase, Protocol):
    def check_request(self, prompt_token_ids: Any, params: Any) -> None:
        """ValueError / TypeError for a request the engine cannot run, in the row-error
        words of docs/row-errors.md."""
        ...

    def check_lora(self, lora_request: LoRARequest | None) -> None:
        """ValueError unless the engine can run `lora_request`."""
        ...

    def lora_names(self) -> AdapterNames | None:
        """How rows name adapters (None without enable_lora)."""
        ...

    def submit(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
               request_id: str | None = None, prompt: str | None = None,
               lora_request: LoRARequest | None = None) -> str:
        """Queue a request; its id."""
        ...

    def export(self, request_id: str, include_kv: bool = False) -> dict[str, Any]:
        """A request as plain data, taken out of the engine."""
        ...

    def import_(self, state: dict[str, Any], front: bool = True) -> str:
        """Continue an exported request here; its id."""
        ...

    def load(self, engine_id: EngineId = None) -> EngineLoad:
        """The engine's load report for a placement policy."""
        ...
