"""What the store's operations return: save results, verify and gc reports (save handles:
:mod:`.save.queue`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SaveResult:
    """Figures of one committed save.

    Attributes:
        step: the checkpoint's step.
        bytes_logical: bytes of tensor data in the state (what a plain copy would hold).
        bytes_written: bytes written to storage: new pack objects plus the manifest.
        snapshot_s: seconds the caller of ``save`` was blocked (back-pressure wait included).
        wait_s: the part of ``snapshot_s`` spent waiting for earlier saves (back-pressure).
        encode_s: seconds spent hashing, delta-encoding and compressing (summed over workers).
        write_s: seconds spent writing objects and the manifest (summed over writers).
        total_s: seconds from ``save`` being called to the checkpoint being committed.
        full_base: whether this checkpoint is a full base (no chunk depends on a delta).
        chunks_total / chunks_reused / chunks_delta / chunks_full: chunks in the state; of them,
            referenced from earlier checkpoints, written as XOR deltas, written standalone.
        objects_written: pack objects written (the manifest not included).
        effort: ``"full"``: every changed chunk coded in full; ``"fast"``: stored as they are;
            ``"paced"``: coded in full while the storage was busy writing, the rest
            (``chunks_as_is``) stored as they are (the store's ``codec_effort``, see
            :mod:`~lightning_incremental.core.commit.effort`).
        chunks_as_is: of ``chunks_full``, the changed chunks stored as they are (codec ``s``)
            to spare CPU or time (``effort``).
        warnings: what went wrong after the commit (retention), each a sentence; the
            checkpoint is committed regardless.
    """

    step: int
    bytes_logical: int
    bytes_written: int
    snapshot_s: float
    wait_s: float
    encode_s: float
    write_s: float
    total_s: float
    full_base: bool
    chunks_total: int
    chunks_reused: int
    chunks_delta: int
    chunks_full: int
    objects_written: int
    warnings: tuple[str, ...] = ()
    effort: str = "full"
    chunks_as_is: int = 0

    @property
    def ratio(self) -> float:
        """Logical bytes per byte written (higher is better)."""
        return self.bytes_logical / self.bytes_written if self.bytes_written else float("inf")


@dataclass
class ObjectCheck:
    """One stored object checked by ``verify``."""

    path: str
    ok: bool
    size: int = 0
    error: str | None = None


@dataclass
class VerifyReport:
    """Every object of one checkpoint checked, and every chunk decoded and hash-compared."""

    step: int
    objects: list[ObjectCheck] = field(default_factory=list)
    chunks_checked: int = 0
    bytes_checked: int = 0
    errors: list[str] = field(default_factory=list)
    # Key paths of the tensors stored lossily (an opt-in codec): their chunks are checked against
    # the hash of their decoded bytes, and they do not restore bit-exact.
    lossy: list[str] = field(default_factory=list)
    # Why the checkpoint could not be read (the storage's error: unreachable, refused, an I/O
    # error), if it could not; that is no finding about its bytes: try again.
    unreadable: str | None = None

    @property
    def ok(self) -> bool:
        """Read whole and found intact."""
        return self.unreadable is None and not self.damaged

    @property
    def damaged(self) -> bool:
        """Something read was found wrong (an object missing or corrupt, a chunk that fails)."""
        return bool(self.errors) or not all(o.ok for o in self.objects)


@dataclass
class GcReport:
    """What ``gc`` removed (or would remove, with ``dry_run``) and what it kept."""

    kept_steps: list[int]
    removed_steps: list[int]
    removed_objects: list[str]
    bytes_freed: int
    dry_run: bool = False
    # A checkpoint kept beyond keep_last because no other kept one is intact, if any.
    kept_intact: int | None = None
