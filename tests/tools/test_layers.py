"""The layer contract, read from the source: every import of every module (module level,
function-local and ``TYPE_CHECKING`` ones alike) points down the layers, and no two modules
import each other, directly or round a circle.

Layers, lowest first (a module may import its own layer's modules and any lower layer's):

- the engine, ``lightning_incremental.core``, in the order its folders follow the data:
  base modules (errors, results, buffers, workers) < ``storage`` | ``codecs`` < ``config`` <
  ``format`` (what is on disk) < ``chunks`` (one chunk's life) < ``commit`` (who may commit) <
  ``save`` | ``load`` < ``maintain`` < the store (``engine``, ``store``, the package);
- ``lightning_incremental.runtime`` (framework-free, every adapter's), in its folders' order:
  ``cluster`` (the job's processes as one) < ``state`` (a rank's own state) < ``policy`` |
  ``memory`` < ``session`` (one run's lifecycle) < the package;
- the command (``lightning_incremental.cli``), the Lightning adapter
  (``lightning_incremental.lightning``) and the Accelerate adapter (``accelerate_incremental``),
  none of which imports another;
- the package root (``lightning_incremental``: lazy public names), above everything.

Layers joined by ``|`` are siblings: neither imports the other (a save never needs the load
path, storage never needs a codec). The fresh-interpreter checks of :mod:`.test_imports` say
the same about what is loaded at run time; this test also sees imports that run late.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("lightning_incremental", "accelerate_incremental")
CORE = "lightning_incremental.core"

# (layer, sibling group): a module may import a module of a lower layer, or of the same layer
# and the same group.
LAYERS: dict[str, tuple[float, str]] = {
    f"{CORE}.errors": (0, "base"),
    f"{CORE}.results": (0, "base"),
    f"{CORE}.buffers": (0, "base"),
    f"{CORE}.workers": (0, "base"),
    f"{CORE}.storage": (1, "storage"),
    f"{CORE}.codecs": (1, "codecs"),
    f"{CORE}.config": (2, "config"),
    f"{CORE}.format": (3, "format"),
    f"{CORE}.chunks": (4, "chunks"),
    f"{CORE}.commit": (5, "commit"),
    f"{CORE}.save": (6, "save"),
    f"{CORE}.load": (6, "load"),
    f"{CORE}.maintain": (7, "maintain"),
    f"{CORE}.engine": (8, "store"),
    f"{CORE}.store": (8, "store"),
    CORE: (8, "store"),
    "lightning_incremental.runtime.cluster": (9.0, "cluster"),
    "lightning_incremental.runtime.state": (9.1, "state"),
    "lightning_incremental.runtime.policy": (9.2, "policy"),
    "lightning_incremental.runtime.memory": (9.2, "memory"),
    "lightning_incremental.runtime.session": (9.3, "session"),
    "lightning_incremental.runtime": (9.4, "runtime"),
    "lightning_incremental.cli": (10, "cli"),
    "lightning_incremental.cli_pool": (10, "cli"),
    "lightning_incremental.lightning": (10, "lightning"),
    "accelerate_incremental": (10, "accelerate"),
    "lightning_incremental": (11, "root"),
}
SIZED = (  # the modules held to the size bound
    CORE,
    "lightning_incremental.runtime",
    "lightning_incremental.lightning",
    "lightning_incremental.cli",
    "lightning_incremental.cli_pool",
    "accelerate_incremental",
)
ANYWHERE = {"lightning_incremental._version"}  # the version: a leaf every layer may read


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(module: str, path: Path) -> Iterator[tuple[str, int, bool]]:
    """(imported module of ours, line, at run time) for every import statement in ``path``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            typing_only.update(id(n) for child in node.body for n in ast.walk(child))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pkg import mod`` imports the module pkg.mod; ``from mod import name`` mod.
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        else:
            continue
        for target in targets:
            if target.split(".")[0] in PACKAGES:
                yield target, node.lineno, id(node) not in typing_only


def _layer(module: str) -> tuple[float, str]:
    """The layer of the longest prefix of ``module`` that has one."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in LAYERS:
            return LAYERS[prefix]
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def _upward(importer: str, imported: str) -> bool:
    if imported in ANYWHERE or imported == importer:
        return False
    (low, group), (high, other) = _layer(imported), _layer(importer)
    return low > high or (low == high and group != other)


def test_every_module_is_in_a_layer() -> None:
    for module in MODULES:
        _layer(module)


def test_imports_point_down_the_layers() -> None:
    wrong = [
        f"{MODULES[m].relative_to(ROOT)}:{line}: {m} ({_layer(m)[1]}) imports {target} "
        f"({_layer(target)[1]})"
        for m, path in MODULES.items()
        for target, line, _ in _imports(m, path)
        if _upward(m, target)
    ]
    assert wrong == [], "imports against the layer order:\n" + "\n".join(wrong)


def _graph() -> dict[str, set[str]]:
    """Run-time imports between our modules; importing ``a.b.c`` also runs ``a`` and ``a.b``."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for target, _, runtime in _imports(module, path):
            if not runtime:
                continue
            parts = target.split(".")
            for end in range(1, len(parts) + 1):
                prefix = ".".join(parts[:end])
                # a package's own __init__ importing its children is not a cycle of theirs
                if prefix in MODULES and prefix != module and not module.startswith(prefix + "."):
                    graph[module].add(prefix)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_the_checker_sees_a_circle_and_an_upward_import() -> None:
    """The checks can fail: a circle through a function-local import, and a save-side module
    importing the load path, are both reported."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    assert _upward(f"{CORE}.save.saver", f"{CORE}.load.loader")
    assert _upward(f"{CORE}.storage.base", f"{CORE}.codecs.bytes")
    assert _upward(f"{CORE}.format.tree", f"{CORE}.save.snapshot")
    assert not _upward(f"{CORE}.load.loader", f"{CORE}.commit.history")
    assert _upward(
        "accelerate_incremental.checkpointer", "lightning_incremental.lightning.callback"
    )


def test_no_module_is_much_over_500_lines() -> None:
    sizes = {m: len(p.read_text().splitlines()) for m, p in MODULES.items() if m.startswith(SIZED)}
    large = {m: n for m, n in sizes.items() if n > 540}
    assert large == {}, f"split these by what their parts do: {large}"
