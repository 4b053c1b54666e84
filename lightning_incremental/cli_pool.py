"""The ``lightning-incremental`` commands of shared object pools and forks: ``fork``, ``unpin``,
``pool-gc``, ``pool-leave``, and what ``ls`` and ``inspect`` add for pools, members and forks.

``fork``, ``unpin``, ``pool-gc`` and ``pool-leave`` are *standalone*: the command does not open
a store at their first argument. ``--storage-option`` applies to every URL they open (local
paths take none).
"""

from __future__ import annotations

import argparse
import io
import json
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table

from lightning_incremental.core import CheckpointStore, ConfigError
from lightning_incremental.core.format import layout as mf
from lightning_incremental.core.maintain.pins import read_pins
from lightning_incremental.core.maintain.pool import (
    POOL_MARKER,
    leave,
    members,
    object_locations,
    open_location,
    read_links,
    unpin,
)
from lightning_incremental.core.maintain.pool_gc import collect_pool
from lightning_incremental.core.storage import Storage
from lightning_incremental.core.storage.linked import TRASH_DIR, LinkedStorage
from lightning_incremental.runtime.session.fork import split_step

Run = Callable[[Any, argparse.Namespace, Console], int]
Command = Callable[[str, Run, str], argparse.ArgumentParser]


def _standalone(run: Run) -> Run:
    """Mark a command's function as opening its own locations (the command opens no store)."""
    setattr(run, "standalone", True)  # noqa: B010
    return run


def register(command: Command) -> None:
    """Add the pool and fork commands through the command table's ``command`` helper."""
    p = command("fork", _fork, "start a new store from a checkpoint of another (no copy in a pool)")
    p.add_argument("dst", help="the new store's location")
    p.add_argument("--pool", default=None, help="the new store's pool (default: the source's)")
    p.add_argument(
        "--as-base",
        action="store_true",
        help="make the step the new store's delta base, not a step of it (a run that starts "
        "again on the source's weights: its own steps reference what did not change)",
    )
    p = command("unpin", _unpin, "remove the pin a fork holds in its source")
    p.add_argument("dst", help="the fork's location")
    p.add_argument("--force", action="store_true", help="even while the fork still needs it")
    p = command("pool-gc", _pool_gc, "collect the pool's objects no member needs (via its trash)")
    p.add_argument(
        "--min-age",
        type=float,
        default=900.0,
        metavar="SECONDS",
        help="never remove an object younger than this, nor than any member's own minimum "
        "(default 900); lower it only when no member saves",
    )
    p.add_argument("--grace", type=float, default=0.0, metavar="SECONDS")
    p.add_argument("--dry-run", action="store_true")
    p = command("pool-leave", _pool_leave, "remove a deleted member's record from a pool")
    p.add_argument("member", help="the member's location (it must hold no checkpoint)")


def _options(args: argparse.Namespace) -> dict[str, Any] | None:
    options: dict[str, Any] = {}
    for pair in args.storage_option:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError("--storage-option expects KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options or None


@_standalone
def _fork(_: Any, args: argparse.Namespace, console: Console) -> int:
    src, step = split_step(args.url)
    options = _options(args)
    chosen = CheckpointStore.fork(
        src,
        args.dst,
        step,
        pool=args.pool,
        storage_options=options,
        src_storage_options=options,
        pool_storage_options=options,
        as_base=args.as_base,
    )
    doc = {"source": src, "step": chosen, "fork": args.dst, "as_base": args.as_base}
    if args.json:
        console.print_json(json.dumps(doc))
    elif args.as_base:
        console.print(
            f"forked step {chosen} of {src} into {args.dst} as its delta base (pinned in the "
            "source; the new store holds no checkpoint until its first save)"
        )
    else:
        console.print(f"forked step {chosen} of {src} into {args.dst} (pinned in the source)")
    return 0


@_standalone
def _unpin(_: Any, args: argparse.Namespace, console: Console) -> int:
    options = _options(args)
    unpin(
        args.url,
        args.dst,
        force=args.force,
        storage_options=options,
        src_storage_options=options,
    )
    if args.json:
        console.print_json(json.dumps({"source": args.url, "fork": args.dst, "unpinned": True}))
    else:
        console.print(f"removed the pin of {args.dst} from {args.url}")
    return 0


@_standalone
def _pool_gc(_: Any, args: argparse.Namespace, console: Console) -> int:
    options = _options(args)
    report = collect_pool(
        args.url,
        min_age_s=args.min_age,
        grace_s=args.grace,
        dry_run=args.dry_run,
        storage_options=options,
        member_options=None if options is None else _EveryUrl(options),
    )
    doc = {
        "members": report.members,
        "live_objects": report.live_objects,
        "removed_objects": len(report.removed_objects),
        "bytes_moved": report.bytes_moved,
        "purged_objects": len(report.purged_objects),
        "bytes_freed": report.bytes_freed,
        "restored_objects": len(report.restored_objects),
        "dry_run": report.dry_run,
    }
    if args.json:
        console.print_json(json.dumps(doc))
    else:
        would = "would " if args.dry_run else ""
        console.print(
            f"{len(report.members)} members, {report.live_objects} live objects; {would}"
            f"moved {len(report.removed_objects)} objects ({report.bytes_moved / 1e6:.1f} MB) "
            f"to the trash, {would}purged {len(report.purged_objects)} from it "
            f"({report.bytes_freed / 1e6:.1f} MB freed), {would}restored "
            f"{len(report.restored_objects)}"
        )
    return 0


class _EveryUrl(dict):  # type: ignore[type-arg]
    """The same storage options for every member URL."""

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__()
        self.options = options

    def get(self, key: Any, default: Any = None) -> Any:
        return self.options


@_standalone
def _pool_leave(_: Any, args: argparse.Namespace, console: Console) -> int:
    options = _options(args)
    leave(args.url, args.member, storage_options=options, member_options=options)
    if not args.json:
        console.print(f"{args.member} left the pool {args.url}")
    else:
        console.print_json(json.dumps({"pool": args.url, "left": args.member}))
    return 0


def _augmented(original: Run, extra: Callable[[CheckpointStore, argparse.Namespace], Any]) -> Run:
    """``original``, then ``extra``'s document: merged into the JSON document with ``--json``,
    else printed after its output (a table, or one line per key)."""

    def run(store: CheckpointStore, args: argparse.Namespace, console: Console) -> int:
        if not args.json:
            code = original(store, args, console)
            shown = extra(store, args)
            if isinstance(shown, Table):
                console.print(shown)
            elif shown:
                for key, value in shown.items():
                    console.print(f"{key}: {value}")
            return code
        buffer = io.StringIO()
        capture = Console(file=buffer, highlight=False, soft_wrap=True, width=10_000)
        code = original(store, args, capture)
        doc = json.loads(buffer.getvalue())
        shown = extra(store, args)
        if isinstance(shown, dict):
            doc.update(shown)
        console.print_json(json.dumps(doc))
        return code

    return run


def pool_aware_ls(original: Run) -> Run:
    """``ls`` (standalone): a pool lists its members; a member or fork also says where its
    objects are."""

    @_standalone
    def run(_: Any, args: argparse.Namespace, console: Console) -> int:
        options = _options(args)
        location = open_location(args.url, options)
        if location.exists(POOL_MARKER) and not location.exists(mf.MARKER):
            return _ls_pool(location, args, console)
        extra = {"min_object_age_s": args.min_age} if getattr(args, "min_age", None) else {}
        with CheckpointStore(
            args.url, storage_options=options, allow_pickle=args.allow_pickle, **extra
        ) as store:
            return _augmented(original, lambda s, _: _links(s.storage))(store, args, console)

    return run


def _ls_pool(pool: Storage, args: argparse.Namespace, console: Console) -> int:
    rows = [
        {"member": r["url"], "min_object_age_s": r.get("min_object_age_s")} for r in members(pool)
    ]
    objects = pool.list(mf.PACK_DIR)
    doc = {"pool": pool.url, "members": rows, "objects": len(objects)}
    if args.json:
        console.print_json(json.dumps(doc))
        return 0
    table = Table(title=f"members of the pool {pool.url} ({len(objects)} objects)")
    table.add_column("member")
    table.add_column("min object age (s)", justify="right")
    for row in sorted(rows, key=lambda r: r["member"]):
        table.add_row(row["member"], str(row["min_object_age_s"]))
    console.print(table)
    return 0


def _links(storage: Storage) -> dict[str, Any]:
    pins = [
        {"step": p.step, "fork": p.by, **({"via": p.via} if p.via else {})}
        for p in read_pins(storage)
    ]
    out: dict[str, Any] = {"pinned_by_forks": pins} if pins else {}
    if not isinstance(storage, LinkedStorage):
        return out
    links = read_links(storage.own)
    out["objects_in"] = storage.objects.url
    if storage.sources:
        out["reads_from"] = [s.url for s in storage.sources]
    if links is not None and links.forked_from:
        out["forked_from"] = links.forked_from
    return out


def pool_aware_inspect(original: Run) -> Run:
    """``inspect``: also the bytes of the checkpoint's objects by where they lie — owned (this
    store's location), in its pool (shared), or in a source it was forked from."""

    def where(store: CheckpointStore, args: argparse.Namespace) -> Any:
        doc = store.manifest(args.step)
        storage = store.storage
        owned = {storage.own.url if isinstance(storage, LinkedStorage) else storage.url}
        pool = storage.objects.url if isinstance(storage, LinkedStorage) else None
        totals: dict[str, int] = {}
        for path, size in doc.packs.items():
            found = storage.where(path) if isinstance(storage, LinkedStorage) else storage.url
            kind = (
                "missing"
                if found is None
                else "owned"
                if found in owned
                else "pool"
                if found == pool
                else "pool trash"
                if found == f"{pool}/{TRASH_DIR}"
                else f"source {found}"
            )
            totals[kind] = totals.get(kind, 0) + size
        if args.json:
            return {"object_bytes_by_location": totals, "locations": object_locations(storage)}
        table = Table(title="object bytes by location")
        table.add_column("location")
        table.add_column("MB", justify="right")
        for kind, size in sorted(totals.items()):
            table.add_row(kind, f"{size / 1e6:.2f}")
        return table

    return _augmented(original, where)
