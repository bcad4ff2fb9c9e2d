"""The `batchgen-data` command (`batchgen_data.cli.main`)."""
from __future__ import annotations

from batchgen_data.cli.main import main

__all__ = ["main"]
