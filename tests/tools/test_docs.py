"""Every fenced code block of the documentation (docs/**/*.md) and of README.md is either run
here or marked as not runnable.

- ``python`` blocks run, each in a fresh temporary directory, in a subprocess, unless the line
  before the fence is ``<!-- not run: reason -->``. ``<!-- slow -->`` there marks a block only
  the whole suite runs.
- ``bash``, ``console`` and ``shell`` blocks never run and must carry ``<!-- not run: reason -->``.
- ``text`` blocks are not code; ``json``, ``yaml`` and ``toml`` blocks must parse.
- Any other kind of block, or one without a kind, fails.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*\S.*-->\s*$")
SLOW = re.compile(r"^\s*<!--\s*slow\s*-->\s*$")
COMMANDS = {"bash", "console", "shell", "sh"}
DATA = {"json", "yaml", "toml"}
RUN_TIMEOUT_S = 120


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    kind: str
    code: str
    not_run: bool
    slow: bool

    @property
    def name(self) -> str:
        try:
            where = self.path.relative_to(ROOT)
        except ValueError:
            where = self.path
        return f"{where.as_posix()}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown file, with the marker on the line before each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence, indent = opening.group("fence"), len(opening.group("indent"))
        kind = opening.group("info").strip().split(" ")[0].strip("{}.").lower()
        previous = lines[i - 1] if i > 0 else ""
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][indent:] if lines[j][:indent].isspace() else lines[j])
            j += 1
        if j == len(lines):
            raise AssertionError(f"{path}:{i + 1}: a code block that is never closed")
        found.append(
            Block(
                path,
                i + 1,
                kind,
                "\n".join(body) + "\n",
                bool(NOT_RUN.match(previous)),
                bool(SLOW.match(previous)),
            )
        )
        i = j + 1
    return found


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def problem(block: Block) -> str | None:
    """Why a block breaks the convention, or None."""
    if block.kind == "python" or block.kind == "text":
        return None
    if block.kind in COMMANDS:
        return (
            None
            if block.not_run
            else (
                f"a {block.kind} block must be marked <!-- not run: reason --> on the line "
                "before it"
            )
        )
    if block.kind == "json":
        json.loads(block.code)
    elif block.kind == "toml":
        tomllib = pytest.importorskip("tomllib")  # Python 3.11+
        tomllib.loads(block.code)
    elif block.kind == "yaml":
        yaml = pytest.importorskip("yaml")
        yaml.safe_load(block.code)
    else:
        return (
            f"a block of kind {block.kind!r} is neither run nor known: use python, text, "
            f"{', '.join(sorted(COMMANDS | DATA))}"
        )
    return None


def run(block: Block, workdir: Path) -> subprocess.CompletedProcess[str]:
    """Run a python block as a script in ``workdir``, with this checkout importable."""
    script = workdir / "block.py"
    script.write_text(block.code, encoding="utf-8")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONHASHSEED", "0")
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=workdir,
        env=env,
        text=True,
        capture_output=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )


ALL = [block for path in documents() for block in blocks(path)]
RUNNABLE = [b for b in ALL if b.kind == "python" and not b.not_run]


def test_the_documents_have_code_blocks() -> None:
    assert len(documents()) > 5 and RUNNABLE  # the search found the site and the README


@pytest.mark.parametrize("block", ALL, ids=[b.name for b in ALL])
def test_every_block_is_run_or_marked(block: Block) -> None:
    reason = problem(block)
    assert reason is None, f"{block.name}: {reason}"


@pytest.mark.parametrize(
    "block",
    [pytest.param(b, marks=pytest.mark.slow) if b.slow else b for b in RUNNABLE],
    ids=[b.name for b in RUNNABLE],
)
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    out = run(block, tmp_path)
    assert out.returncode == 0, f"{block.name} failed:\n{out.stdout}\n{out.stderr}"


def test_the_checks_fail_on_broken_blocks(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nraise SystemExit('broken')\n```\n\n"
        "```bash\nrm -rf /\n```\n\n"
        "<!-- not run: an example -->\n```bash\necho fine\n```\n\n"
        "```\nno kind\n```\n\n"
        "```json\n{not json\n```\n\n"
        "<!-- not run: a fragment -->\n```python\nundefined_name\n```\n",
        encoding="utf-8",
    )
    found = blocks(page)
    assert [(b.kind, b.not_run) for b in found] == [
        ("python", False),
        ("bash", False),
        ("bash", True),
        ("", False),
        ("json", False),
        ("python", True),
    ]
    assert run(found[0], tmp_path).returncode != 0
    assert problem(found[1]) is not None and problem(found[2]) is None
    assert problem(found[3]) is not None
    with pytest.raises(json.JSONDecodeError):
        problem(found[4])
