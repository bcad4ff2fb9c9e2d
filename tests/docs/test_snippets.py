"""Every ```python block in README.md and docs/*.md runs as a user would paste it.

Each block runs alone in a fresh interpreter from the repository root, on the embedded default
model, so a block that needs an import or a variable from elsewhere fails here as it would for a
reader. Only the size shrinks: the example JSONL becomes its first rows, `max_tokens` is capped,
one Ray actor or Spark core stands in for two (each loads the model) and the output path moves
to a temp dir. A block may opt out with a comment
`# doctest: skip-because <reason>` (a cluster address, an API listing); the reason is required.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)
SKIP = re.compile(r"^\s*#\s*doctest:\s*skip-because\b(.*)$", re.M)
DATA = "examples/data/prompts.jsonl"
ROWS = 8  # enough that one Parquet file per row would show
MAX_TOKENS = 8
OUTPUT_DIR = "/tmp/batchgen_out"
# Every engine loads the model (seconds and ~4 GiB each): one per snippet pipeline is enough here.
PARALLELISM = [("concurrency=2", "concurrency=1"),
               ("ActorPoolStrategy(size=2", "ActorPoolStrategy(size=1"),
               ('master("local[2]")', 'master("local[1]")')]


@dataclass(frozen=True)
class Snippet:
    doc: Path
    index: int
    line: int
    source: str

    @property
    def id(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"

    @property
    def skip_reason(self) -> str | None:
        m = SKIP.search(self.source)
        return None if m is None else m.group(1).strip()


def snippets() -> list[Snippet]:
    found = []
    for doc in DOCUMENTS:
        text = doc.read_text()
        for i, m in enumerate(FENCE.finditer(text)):
            found.append(Snippet(doc, i, text.count("\n", 0, m.start()) + 1, m.group(1)))
    return found


def shrink(source: str, data: Path, out_dir: Path) -> str:
    """The block with small inputs: fewer rows, fewer tokens, output in the test's temp dir."""
    source = source.replace(DATA, str(data)).replace(OUTPUT_DIR, str(out_dir))
    for wide, narrow in PARALLELISM:
        source = source.replace(wide, narrow)
    cap = lambda m: m.group(1) + str(min(int(m.group(2)), MAX_TOKENS))  # noqa: E731
    return re.sub(r"""(["']?max_tokens["']?\s*[:=]\s*)(\d+)""", cap, source)


def test_documents_have_snippets() -> None:
    found = snippets()
    assert len(found) >= 5, [s.id for s in found]
    for s in found:  # a skip must say why
        assert s.skip_reason is None or s.skip_reason, f"{s.id}: skip-because needs a reason"
    assert found[0].doc.name == "README.md" and "llm.chat" in found[0].source
    # the run below stays small only while the documents still match the shrinking rules
    for s in found:
        small = shrink(s.source, Path("/data.jsonl"), Path("/out"))
        assert DATA not in small and OUTPUT_DIR not in small, s.id
        assert not re.search(r"size=2|concurrency=2|local\[2\]", small), s.id
        assert all(int(n) <= MAX_TOKENS for n in re.findall(r"max_tokens\W{1,4}(\d+)", small))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("snippet", snippets(), ids=lambda s: s.id)
def test_snippet_runs(snippet: Snippet, tmp_path: Path) -> None:
    if snippet.skip_reason:
        pytest.skip(snippet.skip_reason)
    for module in ("ray", "pyspark"):
        if re.search(rf"^\s*(import|from) {module}\b", snippet.source, re.M):
            pytest.importorskip(module)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join((ROOT / DATA).read_text().splitlines(keepends=True)[:ROWS]))
    out_dir = tmp_path / "out"
    script = tmp_path / "snippet.py"
    script.write_text(shrink(snippet.source, data, out_dir))
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=560)
    assert proc.returncode == 0, f"{snippet.id} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"

    if snippet.doc.name == "README.md" and snippet.index == 0:
        # the first thing a reader runs must answer, not print an empty line
        assert "Paris" in proc.stdout, proc.stdout
    if out_dir.exists():  # a written job: the rows are all there, not one file per row
        import pyarrow.parquet as pq

        files = list(out_dir.rglob("*.parquet"))
        assert pq.read_table(out_dir).num_rows == ROWS
        assert len(files) < ROWS, f"{len(files)} Parquet files for {ROWS} rows"
