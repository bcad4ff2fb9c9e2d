"""`make test`'s CPU-kind passes run the tests marked `cpu_kind` from the paths the Makefile lists
(collecting the whole suite once per kind would cost ~15 s a pass): every marked test must lie
under one of them, and each emulated kind must set all three variables that make a kind."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _make_list(name: str) -> list[str]:
    """The words of a `NAME := ...` Makefile variable, continuation lines included."""
    text = (ROOT / "Makefile").read_text()
    match = re.search(rf"^{name} :=((?:.*\\\n)*.*)$", text, re.M)
    assert match, f"no {name} in the Makefile"
    return match.group(1).replace("\\\n", " ").split()


def test_every_cpu_kind_test_is_in_a_listed_path() -> None:
    listed = _make_list("CPU_KIND_TESTS")
    assert all((ROOT / p).exists() for p in listed), listed
    mark = re.compile(r"^(@pytest\.mark\.cpu_kind\b|pytestmark = .*pytest\.mark\.cpu_kind)", re.M)
    marked = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").rglob("test_*.py")
                    if mark.search(f.read_text()))
    assert "tests/integration/test_cpu_kinds.py" in marked
    left_out = [f for f in marked if not any(f == p or f.startswith(p.rstrip("/") + "/")
                                             for p in listed)]
    assert not left_out, f"add these to CPU_KIND_TESTS in the Makefile: {left_out}"


def test_each_kind_caps_the_c_kernels_onednn_and_aten() -> None:
    kinds = dict(k.split(":", 1) for k in _make_list("CPU_KINDS"))
    assert set(kinds) == {"avx2", "avx512-no-bf16"}
    for name, spec in kinds.items():
        assert {v.split("=")[0] for v in spec.split(",")} == {
            "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "BATCHGEN_CPU_ISA"}, name
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in kinds["avx2"].split(",")
    assert "ONEDNN_MAX_CPU_ISA=AVX512_CORE" in kinds["avx512-no-bf16"].split(",")
