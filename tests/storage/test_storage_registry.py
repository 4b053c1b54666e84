"""The scheme registry: built-in backends imported only when used, code registrations, clear
errors for unknown schemes and missing dependencies, and third-party backends found through the
``lightning_incremental.storage`` entry-point group — tested for real, by installing a
distribution's metadata (``*.dist-info`` with ``entry_points.txt``) on a fresh interpreter's
``sys.path``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lightning_incremental.core import ConfigError
from lightning_incremental.core.storage import (
    ENTRY_POINT_GROUP,
    FsspecStorage,
    LocalStorage,
    Storage,
    backend_for,
    open_storage,
    register_scheme,
    registered_schemes,
    unregister_scheme,
)
from tests import storage_plugin

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def scratch_scheme() -> Iterator[str]:
    """A scheme name for the test, unregistered afterwards."""
    yield "li-scratch"
    unregister_scheme("li-scratch")


# ------------------------------------------------------------------------------ in process


def test_local_paths_and_fsspec_urls(tmp_path: Path) -> None:
    assert isinstance(open_storage(tmp_path / "a", None), LocalStorage)
    assert isinstance(open_storage(f"file://{tmp_path}/b", None), LocalStorage)
    memory = open_storage("memory://li-registry/x", None)
    assert isinstance(memory, FsspecStorage) and memory.url == "memory:///li-registry/x"


def test_s3_is_registered_and_imported_lazily() -> None:
    assert {"s3", "s3a"} <= set(registered_schemes())
    found = backend_for("S3")
    assert found is not None and found.source.endswith("storage.s3:S3Storage.from_url")
    assert found.install_hint == "pip install 'lightning-incremental[s3]'"


def test_registering_a_factory(scratch_scheme: str) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    def factory(url: str, options: dict[str, Any]) -> Storage:
        seen.append((url, options))
        return storage_plugin.open_dict_storage(f"dictmem://{scratch_scheme}/x", {})

    register_scheme(scratch_scheme.upper(), factory)
    assert scratch_scheme in registered_schemes()
    storage = open_storage(f"{scratch_scheme}://b/x", {"token": "t"})
    assert isinstance(storage, storage_plugin.DictStorage)
    assert seen == [(f"{scratch_scheme}://b/x", {"token": "t"})]
    with pytest.raises(ConfigError, match="registered already; pass replace=True"):
        register_scheme(scratch_scheme, factory)
    register_scheme(scratch_scheme, "tests.storage_plugin:open_dict_storage", replace=True)
    url = f"{scratch_scheme}://b/x"
    with pytest.raises(ConfigError, match="not a dictmem:// URL"):
        open_storage(url, None)  # the new factory was used
    unregister_scheme(scratch_scheme)
    with pytest.raises(ConfigError, match=f"unknown storage protocol '{scratch_scheme}'"):
        open_storage(url, None)


@pytest.mark.parametrize(
    ("scheme", "factory", "match"),
    [
        ("", "m:f", "a URL scheme is"),
        ("1abc", "m:f", "a URL scheme is"),
        ("a/b", "m:f", "a URL scheme is"),
        ("li-scratch", "no_colon", "callable or 'module:attribute'"),
        ("li-scratch", 42, "callable or 'module:attribute'"),
    ],
)
def test_bad_registrations(scheme: str, factory: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        register_scheme(scheme, factory)
    assert "li-scratch" not in registered_schemes()


def test_an_unknown_scheme_names_the_known_ones_and_the_group() -> None:
    with pytest.raises(ConfigError) as info:
        open_storage("nosuchfs://bucket/x", None)
    text = str(info.value)
    assert "unknown storage protocol 'nosuchfs'" in text
    assert "registered: " in text and "s3, s3a" in text
    assert "fsspec knows: " in text and "memory" in text
    assert repr(ENTRY_POINT_GROUP) in text


def test_a_factory_that_cannot_be_imported_gives_the_install_hint(
    monkeypatch: pytest.MonkeyPatch, scratch_scheme: str
) -> None:
    register_scheme(scratch_scheme, "li_no_such_module:factory", install_hint="pip install x")
    with pytest.raises(ConfigError, match=r"no backend for li-scratch:// is installed \(pip "):
        open_storage(f"{scratch_scheme}://b/x", None)


def test_s3_without_s3fs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "s3fs", None)  # "import s3fs" raises ImportError
    monkeypatch.delitem(sys.modules, "lightning_incremental.core.storage.s3", raising=False)
    with pytest.raises(ConfigError) as info:
        open_storage("s3://bucket/x", None)
    assert "no backend for s3:// is installed (pip install 'lightning-incremental[s3]')" in str(
        info.value
    )


def _python(code: str, *, path: list[Path] = (), env: dict[str, str] | None = None) -> Any:
    """Run ``code`` in a fresh interpreter (``path`` first on sys.path); its last stdout line
    is JSON."""
    pythonpath = os.pathsep.join([*(str(p) for p in path), str(ROOT)])
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": pythonpath, **(env or {})},
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_importing_storage_imports_no_backend() -> None:
    """The dependencies point one way: the registry names backends, never imports them."""
    loaded = _python(
        """
        import json, sys
        import lightning_incremental.core.storage as storage
        storage.registered_schemes()
        print(json.dumps(sorted(m for m in sys.modules if m.startswith(
            ("s3fs", "botocore", "aiobotocore", "lightning_incremental.core.storage.s3")))))
        """
    )
    assert loaded == []


# ------------------------------------------------------------------------------ entry points


def install(site: Path, dist: str, points: dict[str, str], modules: dict[str, str]) -> None:
    """Install a distribution's metadata (as pip would) and its modules into ``site``."""
    info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = [f"[{ENTRY_POINT_GROUP}]", *(f"{k} = {v}" for k, v in points.items())]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for name, source in modules.items():
        (site / f"{name}.py").write_text(textwrap.dedent(source))


BACKEND = """
    from tests.storage_plugin import open_dict_storage
    def open_storage(url, storage_options):
        return open_dict_storage("dictmem://" + url.partition("://")[2], storage_options)
"""


def test_a_plugin_backend_is_found_and_used(tmp_path: Path) -> None:
    install(
        tmp_path,
        "li-test-backend",
        {"myscheme": "li_test_backend:open_storage"},
        {"li_test_backend": BACKEND},
    )
    out = _python(
        """
        import json, sys
        import torch
        from lightning_incremental.core import CheckpointStore
        from lightning_incremental.core.storage import open_storage, registered_schemes
        before = "li_test_backend" in sys.modules
        schemes = registered_schemes()
        listed = "li_test_backend" in sys.modules
        storage = open_storage("myscheme://space/store", None)
        storage.put("a/b", b"bytes")
        again = open_storage("myscheme://space/store", None).get("a/b").decode()
        state = {"w": torch.arange(1000, dtype=torch.float32), "step": 3}
        with CheckpointStore("myscheme://space/ckpts", chunk_size=1024) as store:
            store.save(state, 3).wait()
            loaded = store.load()
        same = torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3
        print(json.dumps({"imported_before": before, "imported_by_listing": listed,
                          "schemes": schemes, "type": type(storage).__name__,
                          "again": again, "round_trip": same}))
        """,
        path=[tmp_path],
    )
    assert out == {
        "imported_before": False,
        "imported_by_listing": False,
        "schemes": sorted(["myscheme", "s3", "s3a"]),
        "type": "DictStorage",
        "again": "bytes",
        "round_trip": True,
    }


BROKEN = {
    "li_raises": "raise RuntimeError('this plug-in is broken')\n",
    "li_odd": """
        NOT_CALLABLE = 42
        def returns_none(url, storage_options):
            return None
        def fails(url, storage_options):
            raise OSError("cannot reach " + storage_options["endpoint"])
        def refuses(url, storage_options):
            raise ValueError("no such region")
    """,
}


def test_broken_plugins_are_named(tmp_path: Path) -> None:
    install(
        tmp_path,
        "li-broken",
        {
            "raises": "li_raises:factory",
            "missing": "li_not_there:factory",
            "notcallable": "li_odd:NOT_CALLABLE",
            "wrongtype": "li_odd:returns_none",
            "fails": "li_odd:fails",
            "refuses": "li_odd:refuses",
            "twice": "li_odd:returns_none",
            "s3": "li_odd:returns_none",
            "bad/name": "li_odd:returns_none",
        },
        BROKEN,
    )
    install(tmp_path / "other", "li-rival", {"twice": "li_odd:fails"}, {})
    out = _python(
        """
        import json, logging
        from lightning_incremental.core.storage import open_storage, registered_schemes
        records = []
        class Keep(logging.Handler):
            def emit(self, record):
                records.append(record.getMessage())
        logging.getLogger("lightning_incremental").addHandler(Keep())
        errors = {}
        for scheme in ("raises", "missing", "notcallable", "wrongtype", "fails", "refuses",
                       "twice"):
            try:
                open_storage(scheme + "://x/y", {"endpoint": "https://secret.example"})
            except Exception as exc:
                errors[scheme] = type(exc).__name__ + ": " + str(exc)
        s3 = type(open_storage("s3://bucket/x", {"anon": True})).__name__
        print(json.dumps({"errors": errors, "s3": s3, "log": records,
                          "schemes": registered_schemes()}))
        """,
        path=[tmp_path, tmp_path / "other"],
    )
    errors = out["errors"]
    assert set(errors) == {
        "raises",
        "missing",
        "notcallable",
        "wrongtype",
        "fails",
        "refuses",
        "twice",
    }
    for scheme, text in errors.items():
        kind = "StorageError" if scheme == "fails" else "ConfigError"  # an OSError: unreachable
        assert text.startswith(f"{kind}: "), text
        assert "secret.example" not in text
        if scheme != "twice":
            assert f"the storage backend for {scheme}:// ({scheme} = li_" in text, text
            assert "(li-broken 1.0)" in text, text
        if scheme not in ("twice", "fails"):
            assert "fix or uninstall" in text, text
    assert "RuntimeError: this plug-in is broken" in errors["raises"]
    assert "No module named 'li_not_there'" in errors["missing"]
    assert "li_odd:NOT_CALLABLE is a int, not callable" in errors["notcallable"]
    assert "it returned a NoneType, not a Storage" in errors["wrongtype"]
    assert errors["fails"] == (
        "StorageError: the storage backend for fails:// (fails = li_odd:fails (li-broken 1.0)) "
        "could not open 'fails://x/y': OSError: cannot reach <storage_options.endpoint>"
    )
    assert "could not open 'refuses://x/y': ValueError: no such region" in errors["refuses"]
    assert "two installed packages provide a storage backend for twice://" in errors["twice"]
    assert "(li-broken 1.0)" in errors["twice"] and "(li-rival 1.0)" in errors["twice"]
    assert out["s3"] == "S3Storage", "a plug-in does not replace a built-in backend"
    assert any("ignoring the storage plug-in s3 = li_odd:returns_none" in m for m in out["log"])
    assert any("'bad/name' is not a URL scheme" in m for m in out["log"])
    assert "bad/name" not in out["schemes"]
