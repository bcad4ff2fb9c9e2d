"""Structured output: constrain what a request may generate (JSON schema, JSON object, regex,
choice, grammar) with a token mask from xgrammar. docs/structured-output.md is the user guide.

`params` is plain data (no grammar engine, no torch); `grammars` compiles constraints;
`logits` is the sampler's step that masks constrained rows.
"""
from __future__ import annotations

from batchgen_data.structured.params import StructuredOutputsParams, from_response_format

__all__ = ["StructuredOutputsParams", "from_response_format"]
