"""The ``lightning-incremental`` command: list, inspect, verify, diff, export, compact and clean.

Exit codes: 0 success; 1 a checkpoint failed verification (or is corrupt); 2 bad usage;
3 no store, or no such checkpoint; 4 another checkpoint or storage error (``verify``: a checkpoint
could not be read, which says nothing about its bytes).
Output is rich tables on a terminal, plain text otherwise; ``--json`` prints one JSON document.
Storage options (``--storage-option key=value``) are used to open the store and never printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from lightning_incremental import cli_pool
from lightning_incremental.core import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointStore,
    ConfigError,
    CorruptCheckpointError,
    StepError,
)
from lightning_incremental.core.format.records import Manifest
from lightning_incremental.core.maintain.export import FORMATS, export_state
from lightning_incremental.core.maintain.export_dcp import export_dcp
from lightning_incremental.core.maintain.export_hf import (
    DEFAULT_MAX_SHARD_SIZE,
    check_source_folder,
    copy_beside,
    export_hf,
    parse_size,
)

EXIT_OK, EXIT_CORRUPT, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_ERROR = 0, 1, 2, 3, 4


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns its exit code (also the process's when run as a script)."""
    args = _parser().parse_args(argv)
    console = Console(stderr=False, highlight=False, soft_wrap=args.json)
    errors = Console(stderr=True, highlight=False)
    try:
        options = _storage_options(args.storage_option)
        if getattr(args.run, "standalone", False):  # opens its own locations (cli_pool)
            return int(args.run(None, args, console))
        extra = (
            {"min_object_age_s": args.min_age} if getattr(args, "min_age", None) is not None else {}
        )
        with CheckpointStore(
            args.url, storage_options=options, allow_pickle=args.allow_pickle, **extra
        ) as store:
            code: int = args.run(store, args, console)
            return code
    except CheckpointNotFoundError as exc:
        errors.print(f"[red]error:[/] {exc}", markup=True, soft_wrap=True)
        return EXIT_NOT_FOUND
    except (ConfigError, StepError) as exc:
        errors.print(f"[red]error:[/] {exc}", markup=True, soft_wrap=True)
        return EXIT_USAGE
    except CorruptCheckpointError as exc:
        errors.print(f"[red]error:[/] {exc}", markup=True, soft_wrap=True)
        return EXIT_CORRUPT
    except (CheckpointError, OSError) as exc:
        errors.print(f"[red]error:[/] {exc}", markup=True, soft_wrap=True)
        return EXIT_ERROR


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-incremental",
        description="Inspect and maintain lightning-incremental checkpoint stores.",
        epilog="exit codes: 0 ok, 1 verification failed, 2 usage, 3 not found, 4 other error",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, run: Callable[..., int], help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.add_argument("url", help="store location: a directory or any fsspec URL")
        p.add_argument("--json", action="store_true", help="print one JSON document")
        p.add_argument(
            "--storage-option",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="fsspec storage option (repeatable); values are JSON or strings",
        )
        p.add_argument(
            "--allow-pickle",
            action="store_true",
            help="accept checkpoints holding pickled objects (runs their code)",
        )
        p.set_defaults(run=run)
        return p

    command("ls", cli_pool.pool_aware_ls(_ls), "list checkpoints (of a pool: its members)")
    p = command(
        "inspect",
        cli_pool.pool_aware_inspect(_inspect),
        "tensors, changes since the parent, the audit trail, where the objects lie",
    )
    p.add_argument("step", nargs="?", type=int, help="step (default: the newest)")
    p = command("verify", _verify, "read and check every object of checkpoints")
    p.add_argument("step", nargs="?", type=int, help="step (default: the newest)")
    p.add_argument("--all", action="store_true", help="verify every committed checkpoint")
    p = command("diff", _diff, "what changed between two checkpoints")
    p.add_argument("a", type=int)
    p.add_argument("b", type=int)
    p = command("export", _export, "write a checkpoint as a plain file that needs no library")
    p.add_argument("step", nargs="?", type=int, help="step (default: the newest)")
    p.add_argument(
        "--to", required=True, type=Path, help="file (for dcp and hf: directory) to write"
    )
    p.add_argument(
        "--format",
        choices=(*FORMATS, "dcp", "hf"),
        default="torch",
        help="dcp: a torch.distributed.checkpoint directory, written piece by piece (a sharded "
        "checkpoint's tensors are never held whole); loads onto any layout with DCP. hf: a "
        "Hugging Face Trainer checkpoint's model weights as save_pretrained writes them "
        "(model.safetensors, or shards and their index), for from_pretrained(DIR) once the "
        "model's config.json is beside them (--from-folder, or --to the checkpoint-N folder)",
    )
    p.add_argument(
        "--from-folder",
        type=Path,
        default=None,
        metavar="DIR",
        help="hf: copy the small files (config.json, tokenizer, ...) of this checkpoint-N folder "
        "into --to; its record must name the exported step",
    )
    p.add_argument(
        "--max-shard-size",
        default=str(DEFAULT_MAX_SHARD_SIZE),
        metavar="SIZE",
        help="hf: the largest weight file (bytes, or e.g. 5GB, 500MB; default 50GB, as "
        "save_pretrained); past it the weights are sharded with an index",
    )
    p.add_argument(
        "--keys",
        nargs="+",
        metavar="KEY",
        default=None,
        help="export only these top-level keys (e.g. state_dict): the others are not read",
    )
    command("compact", _compact, "rewrite the newest checkpoint as a full base")
    p = command("gc", _gc, "delete old checkpoints and unreferenced objects")
    p.add_argument("--keep-last", type=int, default=None, metavar="N")
    p.add_argument(
        "--grace",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="keep unreferenced objects younger than this (a running job may be "
        "about to reference them; default 3600)",
    )
    p.add_argument(
        "--min-age",
        type=float,
        default=None,
        metavar="SECONDS",
        help="never remove an object younger than this, whatever --grace says (default: the "
        "store's min_object_age_s, 900); lower it only when no process writes to the store",
    )
    p.add_argument("--dry-run", action="store_true")
    cli_pool.register(command)
    return parser


def _storage_options(pairs: list[str]) -> dict[str, Any] | None:
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError("--storage-option expects KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options or None


def _emit(console: Console, args: argparse.Namespace, doc: Any, table: Table | None) -> None:
    if args.json:
        console.print_json(json.dumps(doc))
    elif table is not None:
        console.print(table)


@contextmanager
def _progress(
    console: Console, args: argparse.Namespace, total: int, what: str
) -> Iterator[Callable[[], None]]:
    """A progress bar on a terminal (not with --json); silent otherwise."""
    if args.json or not console.is_terminal:
        yield lambda: None
        return
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(what, total=total)
        yield lambda: progress.advance(task)


def _mb(n: int) -> str:
    return f"{n / 1e6:,.2f}"


def _depth(doc: Manifest) -> int:
    return max((r.depth for r in doc.chunks.values()), default=0)


def _ls(store: CheckpointStore, args: argparse.Namespace, console: Console) -> int:
    rows: list[dict[str, Any]] = []
    for step in store.steps():
        try:
            doc = store.manifest(step)
        except CheckpointError as exc:
            rows.append({"step": step, "error": str(exc)})
            continue
        stats, audit = doc.stats, doc.audit
        rows.append(
            {
                "step": step,
                "created": doc.created,
                "generation": doc.generation,
                "world_size": audit.get("world_size"),
                "bytes_logical": stats.get("bytes_logical"),
                "bytes_written": stats.get("bytes_data"),
                "chain_depth": _depth(doc),
                "full_base": bool(stats.get("full_base")),
            }
        )
    if not rows:
        store.manifest()  # raises the precise "empty / not a store" error
    table = Table(title=f"checkpoints in {store.url}")
    for name in ("step", "time (UTC)", "gen", "world", "logical MB", "written MB", "chain", "base"):
        table.add_column(name, justify="right", no_wrap=True)
    for r in rows:
        if "error" in r:
            table.add_row(str(r["step"]), f"[red]unreadable: {r['error']}[/]", *[""] * 6)
            continue
        table.add_row(
            str(r["step"]),
            r["created"][:16].replace("T", " "),
            str(r["generation"]),
            str(r["world_size"]),
            _mb(r["bytes_logical"] or 0),
            _mb(r["bytes_written"] or 0),
            str(r["chain_depth"]),
            "full" if r["full_base"] else "",
        )
    _emit(console, args, {"url": store.url, "checkpoints": rows}, table)
    return EXIT_CORRUPT if any("error" in r for r in rows) else EXIT_OK


def _changed(doc: Manifest, parent: Manifest | None) -> dict[str, bool | None]:
    """Per tensor path: True when its chunks differ from the parent's, None when new."""
    before = {t.path: t.chunks for t in parent.tensors} if parent else {}
    return {
        t.path: (None if t.path not in before else before[t.path] != t.chunks) for t in doc.tensors
    }


def _inspect(store: CheckpointStore, args: argparse.Namespace, console: Console) -> int:
    doc = store.manifest(args.step)
    parent = None
    if doc.parent is not None and doc.parent in store.steps():
        parent = store.manifest(doc.parent)
    changed = _changed(doc, parent)
    lossy = set(doc.lossy_tensors)
    tensors: list[dict[str, Any]] = [
        {
            "path": t.path,
            "dtype": t.dtype,
            "shape": list(t.shape),
            "bytes": t.nbytes,
            "device": t.device,
            "changed": changed[t.path],
            "lossless": t.path not in lossy,
            "codecs": sorted({doc.chunks[d].kind for d in t.chunks}),
        }
        for t in doc.tensors
    ]
    out = {
        "step": doc.step,
        "parent": doc.parent,
        "created": doc.created,
        "generation": doc.generation,
        "stats": doc.stats,
        "audit": doc.audit,
        "chain_depth": _depth(doc),
        "tensors": tensors,
    }
    if args.json:
        _emit(console, args, out, None)
        return EXIT_OK
    console.print(
        f"[bold]checkpoint step {doc.step}[/] of {store.url} "
        f"(parent: {doc.parent}, chain depth {_depth(doc)})"
    )
    if lossy:
        kinds = sorted({k for t in tensors if not t["lossless"] for k in t["codecs"]})
        console.print(
            f"[yellow]{len(lossy)} tensor(s) stored lossily ({', '.join(kinds)}): they restore "
            "approximately, not bit-exact[/]"
        )
    audit = Table(title="audit trail", show_header=False)
    for key, value in sorted(doc.audit.items()):
        audit.add_row(key, json.dumps(value) if isinstance(value, (dict, list)) else str(value))
    audit.add_row("created", doc.created)
    audit.add_row("generation", str(doc.generation))
    for key, value in sorted(doc.stats.items()):
        audit.add_row(key, str(value))
    console.print(audit)
    table = Table(title="tensors")
    for name in ("path", "dtype", "shape", "MB", "since parent"):
        table.add_column(name, justify="left" if name == "path" else "right")
    for t in tensors:
        since = {None: "new", True: "changed", False: ""}[t["changed"]]
        if not t["lossless"]:
            since = f"{since} lossy".strip()
        table.add_row(t["path"], t["dtype"], str(tuple(t["shape"])), _mb(t["bytes"]), since)
    console.print(table)
    return EXIT_OK


def _verify(store: CheckpointStore, args: argparse.Namespace, console: Console) -> int:
    if args.all and args.step is not None:
        raise ConfigError("give a STEP or --all, not both")
    steps = store.steps() if args.all or args.step is None else [args.step]
    if not steps:
        store.manifest()  # raises the precise "empty / not a store" error
    if not args.all and args.step is None:
        steps = steps[-1:]  # a damaged manifest is verify's finding, not an error
    reports = []
    with _progress(console, args, len(steps), "verifying") as advance:
        for step in steps:
            reports.append(store.verify(step))
            advance()
    doc: list[dict[str, Any]] = [
        {
            "step": r.step,
            "ok": r.ok,
            "objects": len(r.objects),
            "chunks": r.chunks_checked,
            "bytes": r.bytes_checked,
            "errors": r.errors + [f"{o.path}: {o.error}" for o in r.objects if not o.ok],
            "unreadable": r.unreadable,
            "lossy_tensors": r.lossy,
        }
        for r in reports
    ]
    table = Table(title=f"verify {store.url}")
    for name in ("step", "result", "objects", "chunks", "MB read", "lossy", "problems"):
        table.add_column(name, justify="right" if name != "problems" else "left")
    for r in doc:
        problems = r["errors"][:5]
        if r["unreadable"]:
            problems.append(f"could not be read: {r['unreadable']}")
        table.add_row(
            str(r["step"]),
            "[red]CORRUPT[/]"
            if r["errors"]
            else "[yellow]UNREADABLE[/]"
            if r["unreadable"]
            else "[green]ok[/]",
            str(r["objects"]),
            str(r["chunks"]),
            _mb(r["bytes"]),
            f"[yellow]{len(r['lossy_tensors'])} tensors[/]" if r["lossy_tensors"] else "",
            "\n".join(problems),
        )
    _emit(console, args, {"url": store.url, "checkpoints": doc}, table)
    if any(r["errors"] for r in doc):
        return EXIT_CORRUPT
    # A storage error is no finding about the checkpoints: not corrupt, try again.
    return EXIT_ERROR if any(r["unreadable"] for r in doc) else EXIT_OK


def _diff(store: CheckpointStore, args: argparse.Namespace, console: Console) -> int:
    a, b = store.manifest(args.a), store.manifest(args.b)
    ta = {t.path: t for t in a.tensors}
    tb = {t.path: t for t in b.tensors}
    rows: list[dict[str, Any]] = []
    for path in sorted(set(ta) | set(tb)):
        if path not in tb:
            rows.append({"path": path, "change": "removed", "bytes_changed": ta[path].nbytes})
        elif path not in ta:
            rows.append({"path": path, "change": "added", "bytes_changed": tb[path].nbytes})
        elif (ta[path].dtype, ta[path].shape) != (tb[path].dtype, tb[path].shape):
            rows.append({"path": path, "change": "retyped", "bytes_changed": tb[path].nbytes})
        elif ta[path].chunks != tb[path].chunks:
            sizes = [b.chunks[h].size for h in tb[path].chunks]
            differing = sum(
                size for size, x, y in zip(sizes, ta[path].chunks, tb[path].chunks) if x != y
            )
            rows.append({"path": path, "change": "changed", "bytes_changed": differing})
    same_tree = a.tree == b.tree
    table = Table(
        title=f"step {args.a} → step {args.b}: {len(rows)} tensors differ"
        + ("" if same_tree else "; plain values differ too")
    )
    for name in ("path", "change", "MB in changed chunks"):
        table.add_column(name)
    for r in rows:
        table.add_row(r["path"], r["change"], _mb(r["bytes_changed"]))
    _emit(
        console,
        args,
        {"a": args.a, "b": args.b, "tensors": rows, "plain_values_equal": same_tree},
        table,
    )
    return EXIT_OK


def _export(store: CheckpointStore, args: argparse.Namespace, console: Console) -> int:
    manifest = store.manifest(args.step)
    step = manifest.step
    if args.format == "hf":
        return _export_hf(store, args, console, step)
    if args.format == "dcp":
        keys = tuple(args.keys) if args.keys else None
        written = export_dcp(
            store.storage, manifest, args.to, keys=keys, allow_pickle=store.config.allow_pickle
        )
        doc: dict[str, Any] = {"step": step, "to": str(args.to), "format": "dcp", "bytes": written}
        if keys:
            doc["keys"] = list(keys)
    else:
        state = store.load(step, map_location="cpu", keys=args.keys)
        written = export_state(state, args.to, args.format)
        doc = {"step": step, "to": str(args.to), "format": args.format, "bytes": written}
        if args.keys:
            doc["keys"] = list(state)
    if not args.json:
        console.print(f"exported step {step} to {args.to} ({args.format}, {_mb(written)} MB)")
    _emit(console, args, doc, None)
    return EXIT_OK


#: The record a Hugging Face Trainer's checkpoint-N folder holds (the store and the step) and
#: the folder's README: never copied by ``--from-folder``.
_TRAINER_RECORD = "incremental_checkpoint.json"
_TRAINER_README = "README.md"


def _export_hf(
    store: CheckpointStore, args: argparse.Namespace, console: Console, step: int
) -> int:
    limit = parse_size(args.max_shard_size)
    folder = args.from_folder
    if folder is not None:
        check_source_folder(folder, step, _TRAINER_RECORD)
    key = args.keys[0] if args.keys else "model"
    if args.keys and len(args.keys) != 1:
        raise ConfigError("--format hf exports one key (the model's state dict), e.g. --keys model")
    # a checkpoint without the key: a ConfigError naming the keys it has
    weights = store.load(step, map_location="cpu", keys=[key])[key]
    files, written = export_hf(weights, args.to, max_shard_size=limit)
    del weights
    copied = copy_beside(folder, args.to, {_TRAINER_RECORD, _TRAINER_README}) if folder else []
    doc: dict[str, Any] = {
        "step": step,
        "to": str(args.to),
        "format": "hf",
        "bytes": written,
        "files": files,
        "copied": copied,
    }
    if not args.json:
        console.print(
            f"exported step {step} to {args.to} (hf, {', '.join(files)}, {_mb(written)} MB)"
        )
        if folder is None and not (Path(args.to) / "config.json").is_file():
            console.print(
                f"from_pretrained({str(args.to)!r}) also needs the model's config.json beside "
                "the weights: copy it from the checkpoint-N folder (--from-folder does)"
            )
    _emit(console, args, doc, None)
    return EXIT_OK


def _compact(store: CheckpointStore, args: argparse.Namespace, console: Console) -> int:
    result = store.compact()
    doc: dict[str, Any] = {
        "compacted": result is not None,
        "bytes_written": result.bytes_written if result else 0,
        "step": result.step if result else store.manifest().step,
    }
    if not args.json:
        console.print(
            f"step {doc['step']}: "
            + (
                f"rewritten as a full base ({_mb(doc['bytes_written'])} MB written)"
                if result
                else "already a full base"
            )
        )
    _emit(console, args, doc, None)
    return EXIT_OK


def _gc(store: CheckpointStore, args: argparse.Namespace, console: Console) -> int:
    report = store.gc(args.keep_last, grace_s=args.grace, dry_run=args.dry_run)
    doc = {
        "kept_steps": report.kept_steps,
        "removed_steps": report.removed_steps,
        "removed_objects": len(report.removed_objects),
        "bytes_freed": report.bytes_freed,
        "dry_run": report.dry_run,
    }
    if not args.json:
        verb = "would remove" if args.dry_run else "removed"
        console.print(
            f"{verb} {len(report.removed_steps)} checkpoint(s) and "
            f"{len(report.removed_objects)} object(s), {_mb(report.bytes_freed)} MB; "
            f"kept steps {report.kept_steps}"
        )
    _emit(console, args, doc, None)
    return EXIT_OK


def run() -> None:
    """Console entry point."""
    sys.exit(main())


if __name__ == "__main__":
    run()
