"""Pooling tasks' parameters and results, in vLLM's shapes.

`PoolingParams` is what one embed / classify / score request asks for (vLLM's field names:
`dimensions`, `use_activation`, and the earlier releases' `normalize`, `truncate_prompt_tokens`,
`activation`). The results mirror vLLM's
`EmbeddingRequestOutput` / `ClassificationRequestOutput` / `ScoringRequestOutput`: a request
output whose `.outputs` is an `EmbeddingOutput` (`.embedding`), `ClassificationOutput`
(`.probs`) or `ScoringOutput` (`.score`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TASKS = ("embed", "classify", "score")


@dataclass(frozen=True)
class PoolingParams:
    """`dimensions`: keep the first k values of a Matryoshka embedding (before normalisation).
    `normalize`: L2-normalise the embedding (None: `use_activation` if given, else the model's
    pooling config decides). `truncate_prompt_tokens`: keep the first k tokens of a longer input
    (-1: as many as the model takes) instead of refusing it. `use_activation` (vLLM's current
    name) or `activation` (its earlier one): classify/score through softmax (sigmoid for one
    label), False gives the raw logits; None means the default, True, as in vLLM. Both are
    stored resolved, so the object reads the same after a round trip through `from_dict`."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    activation: bool | None = None
    use_activation: bool | None = None

    def __post_init__(self) -> None:
        given = {k: v for k, v in (("use_activation", self.use_activation),
                                   ("activation", self.activation)) if v is not None}
        for name, v in given.items():
            if not isinstance(v, bool):
                raise TypeError(f"{name}={v!r}: must be True, False or None")
        if len(set(given.values())) > 1:
            raise ValueError(f"use_activation={self.use_activation!r} and activation="
                             f"{self.activation!r} disagree: give one (use_activation is "
                             "vLLM's current name)")
        on = next(iter(given.values()), True)
        object.__setattr__(self, "activation", on)
        object.__setattr__(self, "use_activation", on)
        if self.normalize is None and "use_activation" in given:
            # vLLM's use_activation is an embedding's normalisation too
            object.__setattr__(self, "normalize", on)
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ValueError(f"dimensions={d!r}: must be an int >= 1")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or (k < 1 and k != -1)):
            raise ValueError(f"truncate_prompt_tokens={k!r}: must be an int >= 1, or -1")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise TypeError(f"normalize={self.normalize!r}: must be True, False or None")

    def truncated(self, ids: list[int], max_len: int) -> list[int]:
        """The first k tokens (k = truncate_prompt_tokens, -1: max_len)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        k = max_len if k == -1 else k
        return ids[:k]

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "PoolingParams":
        d = dict(d or {})
        unknown = sorted(set(d) - {"dimensions", "normalize", "truncate_prompt_tokens",
                                   "activation", "use_activation"})
        if unknown:
            raise TypeError(f"unknown pooling parameter(s) {unknown}")
        return cls(**d)


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput:
    """One finished pooling request (vLLM's `PoolingRequestOutput` and its typed variants)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: Any  # EmbeddingOutput | ClassificationOutput | ScoringOutput
    finished: bool = True
    num_cached_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


EmbeddingRequestOutput = ClassificationRequestOutput = ScoringRequestOutput = PoolingRequestOutput
