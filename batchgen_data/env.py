"""Every environment variable batchgen_data reads, behind typed accessors.

This is the only module that touches ``os.environ``: the rest of the package asks here, so the set
of knobs a user can turn is listed in one place and each value is parsed and checked once. The
accessors read the environment on every call (no import-time snapshot), because Ray actors and
Spark workers often set variables after the package has been imported, and tests monkeypatch them.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_VAR = "BATCHGEN_CACHE_DIR"


def _get_str(name: str) -> str | None:
    """The variable's value, or None when it is unset or blank (``VAR=`` counts as unset)."""
    value = os.environ.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def cache_dir() -> Path:
    """Where converted models and other derived files live.

    ``$BATCHGEN_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/batchgen_data``, else
    ``~/.cache/batchgen_data``. The directory is not created here; writers create it when needed.
    """
    explicit = _get_str(CACHE_DIR_VAR)
    if explicit is not None:
        return Path(explicit).expanduser()
    xdg = _get_str("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg is not None else Path.home() / ".cache"
    return base / "batchgen_data"


def model_cache_dir() -> Path:
    """Where models given as URLs (``file://``, ``s3://``, any fsspec URL) are copied, once per
    node (``batchgen_data/models/sources.py``): ``$BATCHGEN_MODEL_CACHE_DIR`` when set (point it
    at a local disk, e.g. ``/local_disk0/batchgen_models`` on Databricks), else
    ``cache_dir()/models``."""
    explicit = _get_str("BATCHGEN_MODEL_CACHE_DIR")
    return Path(explicit).expanduser() if explicit is not None else cache_dir() / "models"


def cuda_visible_devices() -> str | None:
    """``$CUDA_VISIBLE_DEVICES`` as set (None when unset); "" means no GPU is visible."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def kernel_checks() -> bool:
    """``$BATCHGEN_KERNEL_CHECKS``: debug mode of the Triton launchers, which then check every
    argument's type, shape, dtype, layout and device before launching (default off: the checks
    cost microseconds of host time per launch, and a step launches hundreds). Read once, when
    the kernels are first imported."""
    return _get_flag("BATCHGEN_KERNEL_CHECKS", default=False)


def _get_flag(name: str, default: bool) -> bool:
    value = _get_str(name)
    if value is None:
        return default
    lowered = value.lower()
    if lowered in ("0", "false", "no", "off"):
        return False
    if lowered in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name}={value!r}: expected 0/1, true/false, yes/no or on/off")


CPU_ISAS = ("native", "avx512", "avx2", "none")


def cpu_isa() -> str:
    """``$BATCHGEN_CPU_ISA``: the highest instruction set the C kernels are built for, to
    emulate a lesser CPU kind (docs/cpu.md): ``native`` (default: this CPU's), ``avx512``,
    ``avx2`` (an AVX2-only build on an AVX-512 machine) or ``none`` (no C kernels: the torch
    paths). A level above this CPU's changes nothing. Read when the kernels are first built."""
    value = (_get_str("BATCHGEN_CPU_ISA") or "native").lower()
    if value not in CPU_ISAS:
        raise ValueError(f"BATCHGEN_CPU_ISA={value!r}: expected one of {', '.join(CPU_ISAS)}")
    return value


def c_compiler() -> str | None:
    """``$CC``: the C compiler that builds the CPU kernels (default ``cc``)."""
    return _get_str("CC")
