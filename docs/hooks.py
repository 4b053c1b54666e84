"""Build-time generation for the documentation site (a mkdocs ``hooks:`` module).

- ``<!-- options: package.module.Class -->``, on a line of its own in a page, becomes a table of
  that class's options: the fields of a dataclass, or the parameters of ``__init__`` otherwise,
  with their types and defaults from the source and their descriptions from the class's
  ``Attributes:`` / ``Args:`` docstring section. The source is read statically (``ast``):
  nothing is imported.
- ``benchmarks/results/`` becomes the pages under ``performance/``: one page per report
  (``<name>.md``, with ``<name>.png`` beside it when there is one), a page for the results that
  have no report, and ``<!-- benchmark-results -->`` in ``performance/index.md`` becomes the list
  of them. The figures live in those files only.
"""

from __future__ import annotations

import ast
import json
import logging
import re
import subprocess
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

log = logging.getLogger("mkdocs.plugins.lightning_incremental_docs")

OPTIONS = re.compile(r"^<!--\s*options:\s*([\w.]+)\s*-->[ \t]*$", re.MULTILINE)
RESULTS_LIST = "<!-- benchmark-results -->"
SECTION = re.compile(r"^(Args|Arguments|Attributes|Parameters):\s*$")
ENTRY = re.compile(r"^    (\*{0,2}[\w]+(?:,\s*\*{0,2}\w+)*)(?:\s*\([^)]*\))?:\s?(.*)$")
RESULTS = Path("benchmarks") / "results"
PERF = "performance"


def _root(config: MkDocsConfig) -> Path:
    return Path(config.config_file_path).resolve().parent


# ----------------------------------------------------------------------------- options tables


def _module_file(root: Path, module: str) -> Path:
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    raise PluginError(f"options: no module {module!r} under {root} (looked for {base}.py)")


def _constants(root: Path, path: Path, depth: int = 0) -> dict[str, Any]:
    """Module-level names bound to literal arithmetic, and such names imported from modules of
    this repository (one level deep)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and depth == 0 and node.level == 0:
            try:
                other = _constants(root, _module_file(root, node.module), depth + 1)
            except PluginError:
                continue
            for alias in node.names:
                if alias.name in other:
                    names[alias.asname or alias.name] = other[alias.name]
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                try:
                    names[target.id] = _evaluate(node.value, names)
                except ValueError:
                    pass
    return names


def _evaluate(node: ast.expr, names: dict[str, Any]) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand, names)
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left, names), _evaluate(node.right, names)
        ops = {
            ast.Add: "__add__",
            ast.Sub: "__sub__",
            ast.Mult: "__mul__",
            ast.LShift: "__lshift__",
        }
        op = ops.get(type(node.op))
        if op is not None and all(isinstance(v, (int, float)) for v in (left, right)):
            return getattr(left, op)(right)
    raise ValueError(ast.unparse(node))


def _default(node: ast.expr | None, names: dict[str, Any]) -> str:
    if node is None:
        return "required"
    if isinstance(node, ast.Name):  # a named constant: show its value
        try:
            return repr(_evaluate(node, names))
        except ValueError:
            pass
    return ast.unparse(node)


def _documented(doc: str) -> dict[str, str]:
    """``name -> description`` from the ``Args:`` / ``Attributes:`` sections of a Google-style
    docstring (``a, b, c: text`` documents three names)."""
    found: dict[str, str] = {}
    current: list[str] | None = None
    in_section = False
    for line in doc.splitlines():
        if SECTION.match(line):
            in_section, current = True, None
            continue
        if not in_section:
            continue
        if line and not line.startswith(" "):  # a new section or prose: this one ended
            in_section, current = False, None
            continue
        entry = ENTRY.match(line)
        if entry:
            current = [name.strip().lstrip("*") for name in entry.group(1).split(",")]
            for name in current:
                found[name] = entry.group(2).strip()
        elif current and line.strip():
            for name in current:
                found[name] = f"{found[name]} {line.strip()}"
    return found


def _markdown(text: str) -> str:
    """reST inline markup as Markdown, and escaped for a table cell."""
    text = re.sub(r":\w+:`([^`<]+?)\s*<[^>]+>`", r"\1", text)  # :role:`title <target>`
    text = re.sub(
        r":\w+:`~?([\w.]+?)`",
        lambda m: f"`{m.group(1).split('.')[-1]}`" if m.group(0).count("~") else f"`{m.group(1)}`",
        text,
    )
    text = text.replace("``", "`")
    return text.replace("|", "\\|")


def _code(text: str) -> str:
    return f"`{text}`" if text else ""  # a table cell's code span may hold "|" as it is


def options_table(root: Path, target: str) -> str:
    """The Markdown table of ``target``'s options (``package.module.Class``)."""
    module, _, name = target.rpartition(".")
    path = _module_file(root, module)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    if cls is None:
        raise PluginError(f"options: no class {name!r} in {path}")
    names = _constants(root, path)
    docs = _documented(ast.get_docstring(cls) or "")
    rows: list[tuple[str, str, str]] = []  # name, type, default
    dataclass = any("dataclass" in ast.unparse(d) for d in cls.decorator_list)
    if dataclass:
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if "ClassVar" in ast.unparse(node.annotation):
                    continue
                rows.append(
                    (node.target.id, ast.unparse(node.annotation), _default(node.value, names))
                )
    else:
        init = next(
            (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None
        )
        if init is None:
            raise PluginError(f"options: {target} is neither a dataclass nor has __init__")
        docs = {**_documented(ast.get_docstring(init) or ""), **docs}
        args = init.args
        positional = args.posonlyargs + args.args
        pos_defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults))
        pos_defaults += list(args.defaults)
        pairs = list(zip(positional, pos_defaults)) + list(zip(args.kwonlyargs, args.kw_defaults))
        for arg, value in pairs:
            if arg.arg == "self":
                continue
            annotation = ast.unparse(arg.annotation) if arg.annotation else ""
            rows.append((arg.arg, annotation, _default(value, names)))
        if args.kwarg is not None:
            rows.append((f"**{args.kwarg.arg}", "", ""))
            docs.setdefault(f"**{args.kwarg.arg}", docs.get(args.kwarg.arg, ""))
    lines = ["| option | type | default | meaning |", "| --- | --- | --- | --- |"]
    for option, annotation, default in rows:
        doc = docs.get(option.lstrip("*"), "")
        if not doc:
            log.warning(
                "options: %s.%s has no description in the docstring of %s (%s)",
                name,
                option,
                target,
                path,
            )
        lines.append(f"| `{option}` | {_code(annotation)} | {_code(default)} | {_markdown(doc)} |")
    source = path.relative_to(root).as_posix()
    note = f"<small>Generated from the docstring of `{target}` ({source}).</small>"
    return "\n".join(lines) + f"\n\n{note}\n"


# ----------------------------------------------------------------------------- benchmark pages


def _results(root: Path) -> Path:
    return root / RESULTS


def _title(text: str, default: str) -> str:
    for line in text.splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return default


def _dated(root: Path, path: Path) -> str:
    """The date of the commit that last changed ``path`` (empty outside a git checkout)."""
    try:
        out = subprocess.run(
            ["git", "log", "-1", "--format=%cs", "--", str(path)],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip()


def _reports(root: Path) -> list[Path]:
    return sorted(_results(root).glob("*.md"))


def _loose_results(root: Path) -> list[Path]:
    """JSON results that no report presents: ``<report>.json``, ``<report>.analysis.json`` and
    ``<report>_<variant>.json`` belong to ``<report>.md``."""
    reports = {p.stem for p in _reports(root)}
    return [
        p
        for p in sorted(_results(root).glob("*.json"))
        if p.name.split(".")[0] not in reports and p.stem.split("_")[0] not in reports
    ]


def _report_page(root: Path, report: Path) -> tuple[str, str]:
    text = report.read_text(encoding="utf-8")
    title = _title(text, report.stem)
    body = text.split("\n", 1)[1] if text.startswith("# ") else text
    stem = report.stem
    source = [f"`{RESULTS.as_posix()}/{report.name}`"]
    for other in sorted(_results(root).glob(f"{stem}.*")):
        if other.suffix != ".md":
            source.append(f"`{other.name}`")
    date = _dated(root, report)
    head = [
        f"# {title}",
        "",
        f"<small>Generated from {', '.join(source)}"
        + (f"; results committed {date}" if date else "")
        + ".</small>",
        "",
        DIRECTIONS,
        "",
    ]
    png = _results(root) / f"{stem}.png"
    if png.is_file():
        head += [f"![{title}]({stem}.png)", ""]
    return title, "\n".join(head) + body


#: said at the top of every generated results page: which way each kind of figure is better
DIRECTIONS = (
    "<small>Reading the figures: bytes, seconds, stalls and memory are better lower; rates "
    "(MB/s), work done and goodput are better higher; a ratio (x) is against the baseline its "
    "column or sentence names — of a cost (time, bytes, memory), below 1x is better; of a "
    "saving (\"x fewer\"), higher is better.</small>"
)


def _loose_page(root: Path) -> str:
    lines = [
        "# Other results",
        "",
        "Results that have no report of their own, as the benchmarks wrote them.",
        "",
    ]
    for path in _loose_results(root):
        data = json.loads(path.read_text(encoding="utf-8"))
        lines += [f"## `{path.name}`", ""]
        date = _dated(root, path)
        if date:
            lines += [f"<small>Committed {date}.</small>", ""]
        if isinstance(data, dict) and all(not isinstance(v, (dict, list)) for v in data.values()):
            lines += ["| key | value |", "| --- | --- |"]
            lines += [
                f"| `{k}` | {v:.4g} |" if isinstance(v, float) else f"| `{k}` | {v} |"
                for k, v in data.items()
            ]
        else:
            lines += ["```json", json.dumps(data, indent=1)[:20000], "```"]
        lines.append("")
    return "\n".join(lines)


def _results_list(root: Path) -> str:
    lines = []
    for report in _reports(root):
        title = _title(report.read_text(encoding="utf-8"), report.stem)
        lines.append(f"- [{title}]({report.stem}.md) (`{report.name}`)")
    if _loose_results(root):
        names = ", ".join(f"`{p.name}`" for p in _loose_results(root))
        lines.append(f"- [Other results](other.md) ({names})")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- mkdocs events


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    """Add every report under benchmarks/results to the "Performance" section of the nav."""
    root = _root(config)
    pages: list[Any] = [
        {_title(r.read_text(encoding="utf-8"), r.stem): f"{PERF}/{r.stem}.md"}
        for r in _reports(root)
    ]
    if _loose_results(root):
        pages.append({"Other results": f"{PERF}/other.md"})
    for item in config.nav or []:
        if isinstance(item, dict) and "Performance" in item:
            section = item["Performance"]
            if not isinstance(section, list):
                section = item["Performance"] = [section]
            section.extend(pages)
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """The generated performance pages and the figures they show."""
    root = _root(config)
    if not _results(root).is_dir():
        raise PluginError(f"no benchmark results at {_results(root)}")
    for report in _reports(root):
        _, content = _report_page(root, report)
        files.append(File.generated(config, f"{PERF}/{report.stem}.md", content=content))
    for png in sorted(_results(root).glob("*.png")):
        files.append(File.generated(config, f"{PERF}/{png.name}", abs_src_path=str(png)))
    if _loose_results(root):
        files.append(File.generated(config, f"{PERF}/other.md", content=_loose_page(root)))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Expand the options tables and the list of benchmark results."""
    root = _root(config)
    markdown = OPTIONS.sub(lambda m: options_table(root, m.group(1)), markdown)
    if RESULTS_LIST in markdown:
        markdown = markdown.replace(RESULTS_LIST, _results_list(root))
    return markdown
