"""``accelerate_incremental._compat`` against the installed Accelerate: each function sees what
a real ``Accelerator(cpu=True)`` prepared and registered; and no other module of the adapter
touches a private Accelerate attribute (a scan of the source, shown to catch one)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import accelerate
import pytest
from packaging.version import Version

from accelerate_incremental import _compat
from tests.accelerate.test_accelerate import _fresh_state, make_run  # noqa: F401

ADAPTER = Path(_compat.__file__).resolve().parent
# Our own attribute on the accelerator instance (the takeover sets and reads it), not Accelerate's.
OURS = {"_incremental_checkpointer"}


def test_installed_accelerate_is_in_the_checked_range() -> None:
    installed = Version(accelerate.__version__).release[:2]
    assert installed >= _compat.OLDEST_SUPPORTED, accelerate.__version__
    if installed > _compat.NEWEST_CHECKED:
        pytest.skip(
            f"Accelerate {accelerate.__version__} is newer than the sources _compat was checked "
            f"against ({_compat.NEWEST_CHECKED}): read them again"
        )


def test_prepared_and_registered_objects() -> None:
    run = make_run()
    acc = run.acc
    assert _compat.models(acc) == [run.model]
    assert _compat.optimizers(acc) == [run.opt]
    assert _compat.schedulers(acc) == [run.sched]
    assert _compat.dataloaders(acc) == [run.loader]
    assert _compat.custom_objects(acc) == [run.counter]
    acc.free_memory()  # Accelerate replaces its lists: they are read anew
    assert _compat.models(acc) == [] and _compat.dataloaders(acc) == []


def test_state_pre_hooks_in_registration_order() -> None:
    acc = make_run().acc

    def first(models: list[Any], weights: list[Any], output_dir: str) -> None: ...
    def second(models: list[Any], weights: list[Any], output_dir: str) -> None: ...
    def loading(models: list[Any], input_dir: str) -> None: ...

    assert _compat.save_state_pre_hooks(acc) == [] == _compat.load_state_pre_hooks(acc)
    handle = acc.register_save_state_pre_hook(first)
    acc.register_save_state_pre_hook(second)
    acc.register_load_state_pre_hook(loading)
    assert _compat.save_state_pre_hooks(acc) == [first, second]
    assert _compat.load_state_pre_hooks(acc) == [loading]
    handle.remove()
    assert _compat.save_state_pre_hooks(acc) == [second]


def test_skip_first_batches_is_accelerates_own_under_a_shadowing_attribute() -> None:
    run = make_run()
    acc = run.acc
    acc.skip_first_batches = lambda *args: pytest.fail("the instance attribute was called")
    skipped = _compat.skip_first_batches(acc, run.loader, 2)
    assert len(list(skipped)) == len(run.loader) - 2


def test_fsdp_requested_reads_the_environment() -> None:
    assert not _compat.fsdp_requested({})
    assert not _compat.fsdp_requested({"ACCELERATE_USE_FSDP": "false"})
    for value in ("true", "True", "1", "yes"):
        assert _compat.fsdp_requested({"ACCELERATE_USE_FSDP": value})


def _private_uses(source: str, filename: str) -> list[str]:
    """``name._attr`` (and ``getattr(x, "_attr")``-style) uses of an underscore attribute on
    anything but ``self``, ``cls`` or one of our own modules; dunders aside."""
    tree = ast.parse(source, filename)
    modules = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "accelerate_incremental"
        for alias in node.names
    }

    def private(name: object) -> bool:
        return (
            isinstance(name, str)
            and name.startswith("_")
            and not name.startswith("__")
            and name not in OURS
        )

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in {"self", "cls", *modules}:
                continue
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in {"getattr", "setattr", "hasattr", "delattr"}
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and private(node.args[1].value)
        ):
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return found


COMPAT = ("_compat.py", "_hf_compat.py")  # Accelerate's internals; transformers' internals


def test_only_compat_touches_private_accelerate_attributes() -> None:
    found = [
        use
        for path in sorted(ADAPTER.glob("*.py"))
        if path.name not in COMPAT
        for use in _private_uses(path.read_text(), path.name)
    ]
    assert found == [], "private framework attributes outside the compat modules:\n" + "\n".join(
        found
    )


def test_the_scan_sees_a_private_use() -> None:
    source = (
        "from accelerate_incremental import _compat\n"
        "def f(acc, self):\n"
        "    _compat.models(acc); self._x; acc._incremental_checkpointer\n"
        "    acc._models; getattr(acc, '_dataloaders'); type(acc).__name__\n"
    )
    assert _private_uses(source, "m.py") == [
        "m.py:4: acc._models",
        "m.py:4: getattr(acc, '_dataloaders')",
    ]
