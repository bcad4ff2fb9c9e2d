"""A request groups the `n` sequences sampled from one prompt, and turns them into output."""
from __future__ import annotations

from dataclasses import dataclass, field

from batchgen_data.core.sequence import Sequence
from batchgen_data.core.stop import StopChecker
from batchgen_data.logprobs import build as build_logprobs
from batchgen_data.lora_request import LoRARequest
from batchgen_data.outputs import CompletionOutput, RequestOutput
from batchgen_data.reasoning.reader import OutputReader, Read
from batchgen_data.sampling_params import SamplingParams


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    pin: str | None = None  # keep its KV under this key once finished (Engine.unpin)
    lora: LoRARequest | None = None  # the adapter its sequences run under

    @property
    def finished(self) -> bool:
        return all(s.status.finished for s in self.seqs)

    def unfinished(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.status.finished]

    def output(self, stopper: StopChecker, reader: OutputReader | None = None
               ) -> RequestOutput:
        """The request as the user gets it; with the engine's `reader` each sample's text is
        its answer, its reasoning and tool calls apart (batchgen_data/reasoning/)."""
        tok, text = stopper.tokenizer, self.params.detokenize
        outs = []
        for s in self.seqs:
            logprobs, cumulative = build_logprobs(s.logprobs, tok, text)
            read = Read(stopper.final_text(s))
            if reader is not None:
                read = reader.read(self.prompt_token_ids, s.output_token_ids, read.text)
            finish = s.status.finish_reason
            if read.tool_calls and finish == "stop":  # OpenAI's reason for an answer of calls
                finish = "tool_calls"
            outs.append(CompletionOutput(
                index=s.index,
                text=read.text,
                token_ids=s.output_token_ids,
                finish_reason=finish,
                logprobs=logprobs,
                stop_reason=s.stop_reason,
                cumulative_logprob=cumulative,
                lora_request=self.lora,
                reasoning_text=read.reasoning,
                num_reasoning_tokens=read.num_reasoning_tokens,
                tool_calls=read.tool_calls,
                tool_call_error=read.tool_call_error,
            ))
        prompt_raw = next((s.prompt_logprobs for s in self.seqs if s.index == 0), None)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            outputs=outs,
            finished=self.finished,
            num_cached_tokens=self.seqs[0].num_cached_tokens if self.seqs else 0,
            prompt_logprobs=build_logprobs(prompt_raw, tok, text)[0],
            lora_request=self.lora,
        )
