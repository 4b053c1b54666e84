"""The codec registry, and a lossy codec end to end: it is registered in one place, labelled in
the manifest, verified against the hash of its decoded bytes, and its corruption is detected."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from lightning_incremental.core import codecs
from lightning_incremental.core.codecs import Codec
from lightning_incremental.core.codecs import bytes as codec_bytes
from lightning_incremental.core.errors import ConfigError, CorruptCheckpointError
from tests.conftest import small_store


class ZeroLowBytes(Codec):
    """Test-only lossy codec: zeroes the lowest mantissa byte of every float32, then zstd."""

    kind = "test-zlb"
    lossless = False

    def encode(
        self, raw: np.ndarray, base: np.ndarray | None, *, width: int, level: int
    ) -> bytes | None:
        if width != 4:
            return None
        kept = raw.copy()
        kept.reshape(-1, 4)[:, 0] = 0  # little-endian: byte 0 is the lowest of the mantissa
        return codec_bytes.compress(kept, level)

    def decode_into(
        self, payload: bytes | memoryview, out: np.ndarray, base: np.ndarray | None, *, width: int
    ) -> None:
        out[:] = np.frombuffer(codec_bytes.decompress(payload, out.size), dtype=np.uint8)


@pytest.fixture
def lossy() -> Iterator[Codec]:
    codec = codecs.register(ZeroLowBytes())
    try:
        yield codec
    finally:
        codecs.unregister(codec.kind)


def test_builtins_are_registered_lossless() -> None:
    assert {"z", "x"} <= set(codecs.kinds())
    assert codecs.get("z").lossless and not codecs.get("z").needs_base
    assert codecs.get("x").lossless and codecs.get("x").needs_base
    # New saves race the byte-plane codecs; "z"/"x" stay registered to read older checkpoints.
    assert [c.kind for c in codecs.automatic()][:2] == ["p", "pd"]
    assert not {"z", "x"} & {c.kind for c in codecs.automatic()}


def test_registry_rejects_duplicates_unknown_kinds_and_lossy_deltas(lossy: Codec) -> None:
    with pytest.raises(ValueError, match="registered already"):
        codecs.register(ZeroLowBytes())
    with pytest.raises(ValueError, match="unknown chunk encoding"):
        codecs.get("nope")

    class LossyDelta(ZeroLowBytes):
        kind = "test-lossy-delta"
        needs_base = True

    with pytest.raises(ValueError, match="cannot be a delta"):
        codecs.register(LossyDelta())
    assert lossy not in codecs.automatic()  # lossy codecs are opt-in only


def test_encode_best_never_picks_a_lossy_codec(lossy: Codec) -> None:
    raw = np.frombuffer(np.random.default_rng(0).standard_normal(4096, np.float32), np.uint8)
    chosen, _ = codecs.encode_best(raw.copy(), None, 4, 1)
    assert chosen.lossless


def test_config_accepts_only_registered_lossy_codecs(local_url: str, lossy: Codec) -> None:
    with pytest.raises(ConfigError, match="unknown chunk encoding"):
        small_store(local_url, lossy_codecs={"state['opt']": "nope"})
    with pytest.raises(ConfigError, match="lossless"):
        small_store(local_url, lossy_codecs={"state['opt']": "z"})


def test_a_lossy_codec_end_to_end(local_url: str, lossy: Codec) -> None:
    g = torch.Generator().manual_seed(0)
    state = {"model": torch.randn(4096, generator=g), "opt": torch.randn(4096, generator=g)}
    with small_store(local_url, lossy_codecs={"state['opt']": lossy.kind}) as store:
        store.save(state, 1).wait()
        manifest = store.manifest(1)
        assert manifest.lossy_tensors == ["state['opt']"]
        assert not manifest.lossless and manifest.to_dict()["version"] == 2
        entry = {t.path: t for t in manifest.tensors}["state['opt']"]
        recipes = [manifest.chunks[d] for d in entry.chunks]
        assert all(r.kind == lossy.kind and not r.lossless and r.decoded for r in recipes)
        assert all(r.decoded != d for r, d in zip(recipes, entry.chunks))
        assert store.verify(1).ok  # verified against the decoded hashes

        restored = store.load(1)
        assert torch.equal(restored["model"], state["model"])  # lossless keys stay exact
        expected = state["opt"].clone()
        expected.view(torch.uint8).view(-1, 4)[:, 0] = 0
        assert torch.equal(restored["opt"], expected)
        assert not torch.equal(restored["opt"], state["opt"])

        # The next save reuses unchanged lossy chunks and never builds a delta on them.
        state["opt"][:10] += 1
        store.save(state, 2).wait()
        second = store.manifest(2)
        assert all(r.base is None for r in second.chunks.values() if not r.lossless)
        assert all(
            second.chunks[r.base].lossless for r in second.chunks.values() if r.base is not None
        )

        # Corrupt a lossy chunk's object: detected, never returned.
        pack = recipes[0].pack
        path = f"{local_url}/{pack}"
        data = bytearray(open(path, "rb").read())
        at = recipes[0].offset + recipes[0].length // 2
        data[at] ^= 0x40
        open(path, "wb").write(bytes(data))
        assert not store.verify(1).ok
        with pytest.raises(CorruptCheckpointError):
            store.load(1)


def test_a_lossy_manifest_needs_its_codec(local_url: str, lossy: Codec) -> None:
    with small_store(local_url, lossy_codecs={"state['opt']": lossy.kind}) as store:
        store.save({"opt": torch.randn(2048)}, 1).wait()
    codecs.unregister(lossy.kind)
    try:
        with small_store(local_url) as store, pytest.raises(CorruptCheckpointError):
            store.load(1)
    finally:
        codecs.register(lossy)
