"""The layout of ``benchmarks/`` (its README's "Layout" section): the harness depends on no
benchmark, no benchmark on another, no file past the size bound, the README names every
module, and every ``python -m benchmarks...`` command the documentation gives names a module
that runs."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
MAX_LINES = 450
COMMAND = re.compile(r"-m (benchmarks(?:\.\w+)*)(?![.\w])")  # not a pattern: .<name>


def _modules(folder: str) -> list[Path]:
    return sorted((BENCH / folder).rglob("*.py"))


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """The benchmarks modules ``path`` imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name.startswith("benchmarks.")}


def _measurement(name: str) -> str:
    """The measurement a suite module belongs to: its package under ``suites/``, or its own
    name."""
    return name.split(".")[2]


def test_no_file_passes_the_size_bound() -> None:
    sizes = {p: len(p.read_text(encoding="utf-8").splitlines()) for p in BENCH.rglob("*.py")}
    large = {str(p.relative_to(ROOT)): n for p, n in sizes.items() if n > MAX_LINES}
    assert not large, f"split these by meaning (at most {MAX_LINES} lines): {large}"


def test_the_harness_imports_no_benchmark_and_no_report() -> None:
    upper = ("benchmarks.suites", "benchmarks.reports")
    found = {_name(path): sorted(i for i in _imports(path) if i.startswith(upper)) for path in
             _modules("harness")}  # fmt: skip
    wrong = {module: imported for module, imported in found.items() if imported}
    assert not wrong, wrong


def test_no_benchmark_imports_another() -> None:
    """What two measurements share belongs in the harness; a measurement may import its own
    jobs (``X_jobs`` runs the jobs of the measurement whose name starts with ``X``)."""
    wrong = {}
    for path in _modules("suites"):
        mine = _measurement(_name(path)) if path.name != "__init__.py" else None
        if mine is None:
            continue
        for target in _imports(path):
            if not target.startswith("benchmarks.suites.") or target.count(".") < 2:
                continue
            theirs = _measurement(target)
            jobs_of_mine = theirs.endswith("_jobs") and mine.startswith(theirs[: -len("_jobs")])
            if theirs != mine and not jobs_of_mine:
                wrong.setdefault(_name(path), []).append(target)
    assert not wrong, wrong


def test_the_readme_names_every_module() -> None:
    text = (BENCH / "README.md").read_text(encoding="utf-8")
    missing = []
    for path in sorted(BENCH.rglob("*.py")):
        if path.name in {"__init__.py", "__main__.py"}:
            continue
        rel = path.relative_to(BENCH)
        if path.parent.parent == BENCH:  # harness/x.py, suites/x.py, reports/x.py
            named = f"`{rel.as_posix()}`" in text
        else:  # a module of a package under suites/: the package's row names it
            named = f"`{rel.parent.as_posix()}/`" in text and f"`{path.name}`" in text
        if not named:
            missing.append(rel.as_posix())
    assert not missing, f"benchmarks/README.md does not describe {missing}"


def _documents() -> list[Path]:
    return [
        ROOT / "README.md",
        BENCH / "README.md",
        *sorted((ROOT / "docs").rglob("*.md")),
        *sorted((BENCH / "results").glob("*.md")),
        *sorted((ROOT / "scripts").glob("*.sh")),
    ]


def test_every_documented_command_names_a_module_that_runs() -> None:
    commands = {
        (path.relative_to(ROOT).as_posix(), name)
        for path in _documents()
        for name in COMMAND.findall(path.read_text(encoding="utf-8"))
    }
    assert len(commands) > 20, "the documents give the benchmarks' commands"
    wrong = []
    for where, name in sorted(commands):
        spec = importlib.util.find_spec(name)
        if spec is None:
            wrong.append(f"{where}: {name} is no module")
        elif spec.submodule_search_locations is not None and (
            importlib.util.find_spec(f"{name}.__main__") is None
        ):
            wrong.append(f"{where}: {name} is a package without __main__")
    assert not wrong, wrong


def test_a_job_from_a_checkout_before_the_folders_runs_its_own_module(tmp_path: Path) -> None:
    """``memory_tier_goodput --before DIR`` runs the job module of that checkout, also one from
    before ``benchmarks/suites/`` existed."""
    from benchmarks.suites.memory_tier_goodput import job_module

    assert job_module(ROOT) == "benchmarks.suites.memory_tier_goodput"
    assert importlib.util.find_spec(job_module(ROOT)) is not None
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "memory_tier_goodput.py").write_text("", encoding="utf-8")
    assert job_module(tmp_path) == "benchmarks.memory_tier_goodput"


@pytest.mark.parametrize("folder", ["harness", "suites", "reports"])
def test_each_folder_says_what_it_holds(folder: str) -> None:
    assert ast.get_docstring(ast.parse((BENCH / folder / "__init__.py").read_text())), folder
