"""docs/ARCHITECTURE.md maps the tree truthfully: every module is named, every named path exists.

A module is every `.py`, `.c` and `.h` file under `batchgen_data/`, `connectors/` and `kernels/`
(a package `__init__.py` only when it holds code, not when it is empty or a docstring alone).
The page names a file by its path from the repository root, from `batchgen_data/`, or from
the folder of the section it sits in (a `###` heading naming a folder, whose table lists that
folder's files): `scheduler.py` under "### `batchgen_data/core/`", `core/scheduler.py` or
`batchgen_data/core/scheduler.py` anywhere (a page from `docs/`). A path the page names (in
backticks, or a link's target) must exist, so a renamed or deleted file cannot stay on the map.
"""
from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "ARCHITECTURE.md"
ROOTS = ("batchgen_data", "connectors", "kernels")
SOURCES = (".py", ".c", ".h")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
HEADING = re.compile(r"^(#+)\s+(.*)$")
TICKED = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
# a backticked word that is a path: no spaces, a folder separator or a source/doc suffix
PATHLIKE = re.compile(r"^[\w./-]+(/|\.(py|c|h|md|sh|txt|toml))$")


def holds_code(init: Path) -> bool:
    """Whether a package `__init__.py` holds more than a docstring."""
    body = ast.parse(init.read_text()).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return bool(body)


def modules(root: Path = ROOT) -> set[str]:
    """Every module file of the three roots, as a path from the repository root."""
    found = set()
    for top in ROOTS:
        for path in (root / top).rglob("*"):
            if path.suffix not in SOURCES or "__pycache__" in path.parts or not path.is_file():
                continue
            if path.name == "__init__.py" and not holds_code(path):
                continue
            found.add(path.relative_to(root).as_posix())
    return found


def named_paths(text: str) -> list[tuple[str, str | None, bool]]:
    """(path as written, the folder of its section or None, is a link) for every path the
    page names outside code blocks."""
    out: list[tuple[str, str | None, bool]] = []
    folder: str | None = None
    for line in FENCE.sub("", text).splitlines():
        if m := HEADING.match(line):
            heading = TICKED.findall(m.group(2))
            folder = heading[0] if len(m.group(1)) >= 3 and heading and \
                heading[0].endswith("/") else None
        for word in TICKED.findall(line):
            word = word.split("::")[0]
            if PATHLIKE.match(word):
                out.append((word, folder, False))
        out += [(target.split("#")[0], None, True) for target in LINK.findall(line)
                if "://" not in target and not target.startswith("#")]
    return out


def resolve(word: str, folder: str | None, link: bool, root: Path = ROOT) -> str | None:
    """The repository path a named path means, or None when nothing there exists."""
    if link:
        bases = ["docs"]
    else:
        bases = ([folder] if folder else []) + ["", "batchgen_data", "docs"]
    root = root.resolve()
    for base in bases:
        path = (root / base / word).resolve()
        if path.exists() and path.is_relative_to(root):
            return path.relative_to(root).as_posix() + ("/" if path.is_dir() else "")
    return None


def check(text: str, files: Iterable[str], root: Path = ROOT) -> tuple[list[str], list[str]]:
    """(module files the page does not name, paths the page names that do not exist)."""
    named, missing = set(), []
    for word, folder, link in named_paths(text):
        where = resolve(word, folder, link, root)
        if where is None:
            missing.append(word if folder is None else f"{word} (under {folder})")
        else:
            named.add(where)
    return sorted(set(files) - named), missing


def test_every_module_is_on_the_map() -> None:
    unnamed, _ = check(PAGE.read_text(), modules())
    assert unnamed == [], f"modules docs/ARCHITECTURE.md does not name: {unnamed}"


def test_every_path_on_the_map_exists() -> None:
    _, missing = check(PAGE.read_text(), modules())
    assert missing == [], f"paths docs/ARCHITECTURE.md names that do not exist: {missing}"


def test_the_map_covers_enough_to_mean_something() -> None:
    # a page whose tables lost their sections would name nothing and pass vacuously
    files = modules()
    assert len(files) > 150 and "batchgen_data/core/scheduler.py" in files
    assert "kernels/cpu/csrc/paged_decode.c" in files
    assert "batchgen_data/core/__init__.py" not in files  # empty: not a module to map


def test_a_new_module_and_a_renamed_path_fail_it() -> None:
    text, files = PAGE.read_text(), modules()
    unnamed, missing = map(set, check(text, files))  # others' work in progress stays out

    def new(page: str, more: frozenset[str] = frozenset()) -> tuple[set[str], set[str]]:
        now_unnamed, now_missing = check(page, files | more)
        return set(now_unnamed) - unnamed, set(now_missing) - missing

    planted = "batchgen_data/core/new_unit.py"
    assert new(text, frozenset({planted})) == ({planted}, set())
    assert new(text.replace("`scheduler_output.py`", "`scheduler_out.py`")) == (
        {"batchgen_data/core/scheduler_output.py"},
        {"scheduler_out.py (under batchgen_data/core/)"})
    assert new(text.replace("`scheduler_output.py`", "`stop.py`")) == (
        {"batchgen_data/core/scheduler_output.py"}, set())
    assert new(text + "\nsee [the map](maps.md)\n") == (set(), {"maps.md"})


def test_a_section_names_its_own_folder_only(tmp_path: Path) -> None:
    for path in ("batchgen_data/a/x.py", "batchgen_data/b/y.py", "connectors/z.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("X = 1\n")
    (tmp_path / "kernels").mkdir()
    (tmp_path / "batchgen_data" / "a" / "__init__.py").write_text('"""only a docstring"""\n')
    page = ("### `batchgen_data/a/`\n\n| file | role |\n|---|---|\n| `x.py` | x |\n"
            "| `y.py` | not here |\n\n## Elsewhere\n\n`b/y.py` and `connectors/z.py`\n")
    files = modules(tmp_path)
    assert files == {"batchgen_data/a/x.py", "batchgen_data/b/y.py", "connectors/z.py"}
    assert check(page, files, tmp_path) == ([], ["y.py (under batchgen_data/a/)"])
