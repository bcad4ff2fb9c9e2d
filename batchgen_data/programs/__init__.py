"""Per-row programs: a row's work as a coroutine of several generations (docs/programs.md).

`api` holds the user's names (`program`, `Generate`, `GenerateResult`); `run` drives one row's
generator with its guards and replay; `steps` turns a Generate into an engine request and back;
`offline` runs many programs over one engine (`LLM.run`); `driven` does the same over an
`EngineDriver` for the Ray and Spark connectors.
"""
from __future__ import annotations

from batchgen_data.programs.api import Generate, GenerateResult, Program, program
from batchgen_data.programs.run import ProgramError, ProgramRun

__all__ = ["Generate", "GenerateResult", "Program", "ProgramError", "ProgramRun", "program"]
