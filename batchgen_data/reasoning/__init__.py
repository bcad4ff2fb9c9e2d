"""Reasoning models' outputs apart: the reasoning, the answer, and their token counts.

Pure text and token logic over a tokenizer, chosen by name (`registry.py`, vLLM's
`reasoning_parser` names); the engine applies the parser when a request finishes
(core/request.py) and a thinking budget reads its tags (core/thinking.py). docs/reasoning.md.
"""
