"""A manifest is read with work bounded by its bytes, whatever it claims.

A compact manifest's tables are one zstd frame, and a few kilobytes of zstd can claim, or hold,
gigabytes. Forged here with a valid checksum, so that only the bound can refuse them: each is a
ManifestError (a corrupt manifest), never a MemoryError, and the reader holds a few megabytes.
Each reader runs in a process of its own whose address space may grow by :data:`HEADROOM`
only, far less than the claims: an allocation in proportion to a claim fails there, as it
would kill a training process on a machine without such a limit.
"""

from __future__ import annotations

import base64
import json
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_incremental.core import CheckpointStore, ManifestError
from lightning_incremental.core.format import canonical, compact, validation
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.format.records import Manifest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="limits a reader's address space (Linux)"
)

GiB = 1 << 30
HEADROOM = 3 * GiB // 2  # address space a reader may take beyond what it holds at its start
_BLOCK = 1 << 17  # zstd's largest block


def _frame(pieces: list[bytes | tuple[bytes, int]], content_size: int | None) -> bytes:
    """A zstd frame made by hand: ``(byte, n)`` pieces as run-length blocks (4 bytes for up to
    128 KiB of output), others as raw blocks; ``content_size`` in its header (None: none, as
    a streaming writer leaves it)."""
    if content_size is None:
        out = struct.pack("<IBB", 0xFD2FB528, 0, 7 << 3)  # a window of 128 KiB
    else:
        out = struct.pack("<IBQ", 0xFD2FB528, 0xE0, content_size)  # one segment, 8-byte size
    blocks: list[tuple[int, int, bytes]] = []
    for piece in pieces:
        if isinstance(piece, tuple):
            byte, n = piece
            blocks += [(1, min(_BLOCK, n - at), byte) for at in range(0, n, _BLOCK)]
        else:
            raw = [piece[at : at + _BLOCK] for at in range(0, len(piece), _BLOCK)]
            blocks += [(0, len(body), body) for body in raw]
    for i, (kind, n, body) in enumerate(blocks):
        out += (int(i == len(blocks) - 1) | kind << 1 | n << 3).to_bytes(3, "little") + body
    return out


def _held(pieces: list[bytes | tuple[bytes, int]]) -> int:
    return sum(p[1] if isinstance(p, tuple) else len(p) for p in pieces)


def _signed(header: dict[str, Any], frame: bytes, size: int) -> bytes:
    """A compact manifest of ``header`` (fields in the clear) whose tables are ``frame``,
    declared ``size`` bytes, with a valid checksum."""
    data = base64.b64encode(frame).decode("ascii")
    tables = {"encoding": compact.ENCODING, "size": size, "data": data}
    return canonical.sign({**header, "tables": tables})


def _header() -> dict[str, Any]:
    empty = Manifest(
        step=2, parent=1, generation=0, since_base=1, chunk_size=4096, created="now",
        tensors=(), chunks={}, packs={},
    )  # fmt: skip
    doc = compact.encode(empty)
    doc.pop("tables")
    return doc


def _bombs() -> dict[str, tuple[bytes, str]]:
    """Forged manifests, each with what the error a reader raises says."""
    header = _header()

    def whole(*pieces: bytes | tuple[bytes, int]) -> bytes:  # declares what it holds
        return _signed(header, _frame(list(pieces), _held(list(pieces))), _held(list(pieces)))

    return {
        # what they claim is refused before anything is decompressed
        "3 GiB of whitespace": (whole((b" ", 3 * GiB - 2), b"{}"), "not decompressed"),
        "a 1 GiB string": (whole(b'{"packs":"', (b"a", GiB), b'"}'), "not decompressed"),
        "a size only claimed": (_signed(header, _frame([b"{}"], 3 * GiB), 3 * GiB), "not decom"),
        # a frame that does not say what it holds, or holds more than it says
        "no content size": (_signed(header, _frame([(b" ", GiB)], None), 1000), "do not hold"),
        "more than declared": (_signed(header, _frame([(b" ", GiB)], 1000), 1000), "tables"),
        # within the bound (any compact manifest may hold 4 MiB of tables): decompressed, then
        # refused as malformed
        "nested too deeply": (whole((b"[", 100_000), (b"]", 100_000)), "nested"),
        "4 MiB of whitespace": (whole((b" ", (4 << 20) - 2), b"{}"), "malformed"),
    }


_READER = textwrap.dedent(
    """
    import json, resource, sys, tracemalloc
    from pathlib import Path
    from lightning_incremental.core.format import canonical

    def grow(limit):
        size = next(l for l in open("/proc/self/status") if l.startswith("VmSize:"))
        cap = (int(size.split()[1]) << 10) + limit
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    grow(int(sys.argv[2]))
    out = {}
    for path in sorted(Path(sys.argv[1]).iterdir()):
        data = path.read_bytes()
        tracemalloc.start()
        try:
            canonical.loads(data, path.name)
            outcome = ["read", ""]
        except BaseException as exc:
            outcome = [type(exc).__name__, str(exc)[:500]]
        outcome.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        out[path.name] = outcome
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def read_bombs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """What a reader process made of each forged manifest: (error, message, peak bytes held)."""
    folder = tmp_path_factory.mktemp("bombs")
    for i, (_, (data, _)) in enumerate(sorted(_bombs().items())):
        (folder / f"{i:02d}").write_bytes(data)
    done = subprocess.run(
        [sys.executable, "-c", _READER, str(folder), str(HEADROOM)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    return {name: found[f"{i:02d}"] for i, name in enumerate(sorted(_bombs()))}


@pytest.mark.parametrize("bomb", sorted(_bombs()))
def test_a_forged_frame_is_a_corrupt_manifest_read_in_bounded_memory(
    read_bombs: dict[str, list[Any]], bomb: str
) -> None:
    error, message, peak = read_bombs[bomb]
    assert error == "ManifestError", (error, message)
    assert _bombs()[bomb][1] in message, message
    # the bound (4 MiB of tables for a small manifest) and its JSON's objects, not the claim
    assert peak < 64 << 20, peak


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((1000,), float(step)), "step": step}


_STORE_READER = textwrap.dedent(
    """
    import json, resource, sys, warnings
    from lightning_incremental.core import CheckpointStore
    from lightning_incremental.core.maintain.pool_gc import collect_pool

    size = next(l for l in open("/proc/self/status") if l.startswith("VmSize:"))
    cap = (int(size.split()[1]) << 10) + int(sys.argv[3])
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    def outcome(call):
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                value = call()
            said = [str(w.message)[:800] for w in caught if "unusable" in str(w.message)]
            return ["ok", value, said]
        except BaseException as exc:
            return [type(exc).__name__, str(exc)[:800], []]

    with CheckpointStore(sys.argv[1]) as store:
        out = {
            "steps": outcome(store.steps),
            "load": outcome(lambda: store.load()["step"]),
            "load 2": outcome(lambda: store.load(2)["step"]),
            "verify 2": outcome(lambda: [store.verify(2).ok, store.verify(2).errors[:1]]),
            "gc": outcome(lambda: store.gc(keep_last=1).removed_steps),
        }
    out["pool gc"] = outcome(lambda: collect_pool(sys.argv[2], min_age_s=0.0).members)
    print(json.dumps(out))
    """
)


def _read_store(store: Path, pool: Path) -> dict[str, list[Any]]:
    done = subprocess.run(
        [sys.executable, "-c", _STORE_READER, str(store), str(pool), str(HEADROOM)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def test_a_store_reads_a_manifest_claiming_gigabytes_as_a_corrupt_one(tmp_path: Path) -> None:
    """Step 2's manifest is a valid-checksum compact manifest claiming 3 GiB of tables: every
    reader treats it as it treats a corrupt manifest (here: one that is not JSON). ``load()``
    falls back to step 1 and says why, ``load(2)`` and ``verify(2)`` name the tables, ``gc``
    and the pool's collection delete nothing; no reader runs out of memory."""
    outcomes = {}
    for case in ("bomb", "corrupt"):
        root, pool = tmp_path / case, tmp_path / f"{case}-pool"
        with CheckpointStore(root, pool=pool) as store:
            for step in (1, 2):
                store.save(_state(step), step).wait()
        manifest = root / mf.manifest_path(2)
        if case == "bomb":
            header = compact.encode(canonical.loads(manifest.read_bytes(), "step 2"))
            header.pop("tables")
            spaces: list[bytes | tuple[bytes, int]] = [(b" ", 3 * GiB - 2), b"{}"]
            manifest.write_bytes(_signed(header, _frame(spaces, _held(spaces)), _held(spaces)))
        else:
            manifest.write_bytes(b"{not json")
        outcomes[case] = _read_store(root, pool)

    bomb, corrupt = outcomes["bomb"], outcomes["corrupt"]
    assert {k: v[0] for k, v in bomb.items()} == {k: v[0] for k, v in corrupt.items()}, bomb
    assert bomb["steps"] == ["ok", [1, 2], []]
    status, step, said = bomb["load"]
    assert (status, step) == ("ok", 1), bomb["load"]
    assert any("step 2" in s and "not decompressed" in s for s in said), said
    assert bomb["load 2"][0] == "ManifestError" and "not decompressed" in bomb["load 2"][1]
    assert bomb["verify 2"][0] == "ok" and bomb["verify 2"][1][0] is False
    assert "not decompressed" in bomb["verify 2"][1][1][0]
    assert bomb["gc"][0] == "CorruptCheckpointError" and "before deleting" in bomb["gc"][1]
    assert bomb["pool gc"][0] == "PoolMemberError" and "deleted nothing" in bomb["pool gc"][1]
    with CheckpointStore(tmp_path / "bomb") as store:  # nothing was removed
        assert store.steps() == [1, 2]


def test_tables_that_compress_past_the_bound_are_written_with_filler(tmp_path: Path) -> None:
    """A state whose tables compress far better than any manifest of tensors (here a plain list
    of four million zeros: about 8 MB of tables in a frame of a few KB) is written with filler
    that brings it within the bound: it reads back, and no reader refuses what was written."""
    state = {f"t{i}": torch.zeros(4) for i in range(1100)}
    state["plain"] = [0] * 4_000_000
    with CheckpointStore(tmp_path) as store:
        store.save(state, 1).wait()
    data = (tmp_path / mf.manifest_path(1)).read_bytes()
    doc = json.loads(data)
    tables = doc["tables"]
    stored = len(tables["data"]) + len(tables.get("pad", ""))
    assert tables["size"] <= compact.limit(stored)
    doc.pop("checksum")
    del tables["pad"]  # without it, beyond what a reader takes
    with pytest.raises(ManifestError, match="not decompressed"):
        canonical.loads(canonical.sign(doc), "without filler")
    canonical.forget_parsed()
    with CheckpointStore(tmp_path) as store:
        out = store.load(1)
        assert store.verify(1).ok
    assert out["plain"] == state["plain"] and torch.equal(out["t7"], state["t7"])


def test_a_shape_of_many_dimensions_is_not_multiplied_out() -> None:
    """A forged shape of many dimensions (200,000 here: 400 KB of JSON, a few hundred bytes
    compact; a million take every reader minutes) is refused once the product passes the
    tensor's bytes: a few multiplications, not one per dimension of a number that grows with
    each."""
    multiplied = [0]

    class Dim(int):  # an int that counts the products it takes part in
        def __mul__(self, other: Any) -> Any:
            multiplied[0] += 1
            return int(self) * other

        __rmul__ = __mul__

    pack = mf.pack_path("ab" * 16)
    doc = Manifest(
        step=1, generation=0, since_base=0, chunk_size=4096, created="now", tensors=(),
        chunks={}, packs={pack: 0},
    ).to_dict()  # fmt: skip
    doc["tensors"] = [
        {"path": "state['w']", "dtype": "float32", "shape": [Dim(3)] * 200_000, "nbytes": 0,
         "width": 4, "device": "cpu", "numpy": False, "param": False, "requires_grad": False,
         "chunks": []}
    ]  # fmt: skip
    with pytest.raises(ManifestError, match="wrong size"):
        validation.parse(doc, "test")
    assert multiplied[0] <= 8, multiplied[0]


def test_a_record_nested_too_deeply_is_an_unreadable_record(tmp_path: Path) -> None:
    """The small records beside the manifests (marker, fence, lease, pin, links) are plain
    JSON: one nested deeper than the parser goes is unreadable like any other that is not
    JSON (the reader's own error, naming the record), not a RecursionError that escapes it."""
    from lightning_incremental.core import CorruptCheckpointError
    from lightning_incremental.core.commit import fencing, lease
    from lightning_incremental.core.maintain import pins, pool
    from lightning_incremental.core.storage import LocalStorage

    deep = b"[" * 100_000
    with pytest.raises(ManifestError, match="not JSON"):
        mf.check_marker(deep, "store.json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        fencing.parse(deep, 3, "fence 3")
    with pytest.raises(CorruptCheckpointError, match="unreadable"):
        pins.parse_pin(deep, "pins/x.json")
    storage = LocalStorage(str(tmp_path))
    storage.put(pool.LINKS, deep)
    with pytest.raises(CorruptCheckpointError, match="unreadable"):
        pool.read_links(storage)
    storage.put(lease.lease_path(1), deep)
    record = lease.newest(storage)
    assert record is not None and record.doc.get("note") == "unreadable"
