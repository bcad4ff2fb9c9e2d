"""docs/ARCHITECTURE.md's import rule holds: every import of every module of the package (lazy
ones in functions too), parsed with `ast`, points at its own line of the rule or a line above."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {"batchgen_data": "batchgen_data", "kernels": "batchgen_data.kernels",
           "connectors": "batchgen_data.connectors"}


def rule() -> dict[str, int]:
    """unit -> its line in the rule (0 = innermost)."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    (block,) = re.findall(r"```import-rule\n(.*?)```", text, re.S)
    return {unit: depth for depth, line in enumerate(block.strip().splitlines())
            for unit in line.split()}


def unit_of(dotted: str) -> str | None:
    """`batchgen_data.core.scheduler` -> `engine`; `batchgen_data` itself -> None."""
    parts = dotted.split(".")
    return parts[1] if parts[0] == "batchgen_data" and len(parts) > 1 else None


def modules() -> list[tuple[str, Path]]:
    out = []
    for folder, dotted in SOURCES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("").parts
            out.append((".".join((dotted, *rel)).removesuffix(".__init__"), path))
    return out


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file; `from batchgen_data import x`
    counts as importing `batchgen_data.x`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "batchgen_data":
                found += [(node.lineno, f"batchgen_data.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, node.module))
    return found


def violations() -> list[str]:
    depth = rule()
    bad = []
    for name, path in modules():
        src = unit_of(name)
        if src is None:  # batchgen_data/__init__.py: the lazy public names
            continue
        assert src in depth, f"{name}: unit {src!r} is not in ARCHITECTURE.md's import rule"
        for line, target in imports(path):
            where = f"{path.relative_to(ROOT)}:{line} imports {target}"
            top = target.split(".")[0]
            if top in ("batchgen_lab", "benchmarks", "sim", "_common"):
                bad.append(f"{where} (the lab or a benchmark)")
            elif top in ("ray", "pyspark") and src not in ("connectors", "cli"):
                bad.append(f"{where} (only connectors and cli import {top})")
            dst = unit_of(target)
            if dst is None or dst == src:
                continue
            if dst not in depth:
                bad.append(f"{where} (unit {dst!r} is not in the rule)")
            elif depth[dst] > depth[src]:
                bad.append(f"{where} (outward: {src} is on line {depth[src]}, {dst} on "
                           f"{depth[dst]})")
    return bad


def test_imports_point_inward_only() -> None:
    assert violations() == []


def test_the_rule_rejects_an_outward_import() -> None:
    # the check can fail: the engine importing the connectors, and layers importing the lab
    real = imports

    def with_extra(path: Path) -> list[tuple[int, str]]:
        extra = {"batchgen_data/engine/engine.py": "batchgen_data.connectors.ray_data",
                 "batchgen_data/layers/attention.py": "batchgen_lab.sim"
                 }.get(path.relative_to(ROOT).as_posix())
        return real(path) + ([(1, extra)] if extra else [])

    globals()["imports"] = with_extra
    try:
        bad = violations()
    finally:
        globals()["imports"] = real
    assert any("engine/engine.py:1 imports batchgen_data.connectors" in b for b in bad)
    assert any("layers/attention.py:1 imports batchgen_lab.sim" in b for b in bad)
    assert len(bad) == 2


def test_layers_take_no_kv_routing_callback() -> None:
    # where a micro-batch's KV lives is the KV cache's business (worker/kv_tier/ gives the
    # caches): the attention metadata and the micro-batch parts hold tensors and plain data
    import dataclasses
    import typing

    from batchgen_data.layers.attention import AttentionMetadata, AttentionPart

    fields = {f.name: str(f.type) for f in dataclasses.fields(AttentionMetadata)}
    fields |= {n: str(t) for n, t in typing.get_type_hints(AttentionPart).items()}
    assert not [n for n, t in fields.items() if "Callable" in t or "route" in n], fields
    for folder in ("layers", "models"):
        for path in (ROOT / "batchgen_data" / folder).glob("*.py"):
            assert "kv_route" not in path.read_text(), path


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of the product it imports (lazy and TYPE_CHECKING imports too;
    `from a.b import c` names the module `a.b.c` when there is one, else `a.b`)."""
    mods = dict(modules())

    def owner(dotted: str) -> str | None:
        while dotted and dotted not in mods:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        if name == "batchgen_data":  # the lazy public names: imported by no module
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                dst = owner(target)
                if dst and dst not in (name, "batchgen_data"):
                    graph[name].add(dst)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected sets of more than one module (Tarjan's
    algorithm, iterative so that a deep chain cannot overflow the stack)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_circles() -> None:
    # a circle among modules (even inside one unit, even through a lazy import) means neither
    # module can be read, tested or moved without the other
    assert circles(import_graph()) == []


def test_the_circle_check_finds_a_new_circle() -> None:
    graph = import_graph()
    assert "batchgen_data.core.sequence" in graph["batchgen_data.core.scheduler"]
    graph["batchgen_data.core.sequence"].add("batchgen_data.core.scheduler")
    found = circles(graph)
    assert len(found) == 1
    assert {"batchgen_data.core.sequence", "batchgen_data.core.scheduler"} <= set(found[0])
