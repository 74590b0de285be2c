"""The ``ckptturbo`` command: look at, check, clean up and convert checkpoints.

A checkpoint in the chunk store is not a directory of files a person can read, so every
question an operator has ("what is in it", "is it intact", "what can I free", "give me a
file my other tool reads") needs a command. Each subcommand is a thin layer over the
library (``catalog``, ``runs``, ``manifest``, ``api``) so the CLI never knows more about the storage
format than the library does.

Exit codes: 0 success, 1 ``verify`` found missing or corrupt chunks, 2 any other error
(printed as one line, ``ckptturbo: error: ...``, never as a traceback).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from . import __version__
from .catalog import CheckpointInfo, collect_garbage, delete_checkpoint, list_checkpoints
from .errors import CheckpointNotFound, CkptTurboError, FormatError, StorageError, names_preview
from .integrity import chunk_users, item_chunks, stored_chunk_problem
from .manifest import Manifest
from .paths import CONTROL_DIR, MANIFEST_NAME
from .runs import Location
from .runtime import default_runtime
from .tiered_catalog import list_tiered
from .tiers import Tiers
from .urls import parent_url

log = logging.getLogger("ckptturbo.cli")

EXIT_OK, EXIT_MISMATCH, EXIT_ERROR = 0, 1, 2
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


# --- small helpers --------------------------------------------------------------------

def human(nbytes: float) -> str:
    """Binary units, because chunk and tensor sizes are powers of two more often than not."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def parse_size(text: str) -> int:
    """'5GB', '500MiB' or '1048576': the spellings HF's max_shard_size and people use."""
    raw = text.strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):]
    if unit not in _SIZE_UNITS or not number:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 500MB, 2GiB or a byte count)")
    try:
        value = int(float(number) * _SIZE_UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


def parse_storage_options(text: str) -> dict[str, Any]:
    """fsspec takes keyword arguments; on a command line a JSON object is the least surprising."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--storage-options is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--storage-options must be a JSON object")
    return value


def iso_time(timestamp: float) -> str:
    """Local time with its offset: readable, yet unambiguous when pasted elsewhere."""
    return datetime.fromtimestamp(timestamp).astimezone().isoformat(timespec="seconds")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: set[int]) -> None:
    """Aligned columns without a dependency; ``right`` names the numeric columns."""
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for row in cells:
        print("  ".join(c.rjust(w) if i in right else c.ljust(w)
                        for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip())


def progress(total: int, desc: str) -> Any:
    """A byte progress bar on a terminal only, so logs and pipes stay clean."""
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                disable=not sys.stderr.isatty())


# --- what a URL holds ------------------------------------------------------------------

def what_is_at(url: str, storage_options: dict[str, Any] | None) -> str:
    """What a URL that is not what a command wants holds: "checkpoint" (a manifest),
    "dcp" (a plain DCP checkpoint's .metadata), "run" (a chunk store), "missing" (nothing
    stored there) or "other". A missing bucket raises CheckpointNotFound naming it."""
    store = default_runtime().open_store(url, storage_options)
    store.check_reachable()
    for name, kind in ((MANIFEST_NAME, "checkpoint"), (".metadata", "dcp"), (CONTROL_DIR, "run")):
        if store.exists(store.join(store.root, name)):
            return kind
    return "other" if store.exists(store.root) else "missing"


def missing(url: str) -> CheckpointNotFound:
    hint = "" if "://" in url else f" (a local path; an object store needs its URL, e.g. s3://{url})"
    return CheckpointNotFound(f"{url} does not exist{hint}")


def read_manifest(url: str, storage_options: dict[str, Any] | None) -> Manifest:
    """The manifest at ``url``, or an error that says what is there instead."""
    try:
        return Location(url, storage_options).read_manifest()
    except CheckpointNotFound as exc:
        kind = what_is_at(url, storage_options)
        if kind == "missing":
            raise missing(url) from exc
        if kind == "run":
            raise CheckpointNotFound(f"{url} is a run, not a checkpoint: `ckptturbo ls {url}` "
                                     "lists its checkpoints") from exc
        if kind == "dcp":
            raise FormatError(f"{url} is a plain DCP checkpoint (torch.distributed.checkpoint's "
                              ".metadata), not a ckptturbo one: read it with "
                              "dcp.FileSystemReader") from exc
        raise


# --- ls ------------------------------------------------------------------------------

def cmd_ls(args: argparse.Namespace) -> int:
    """Committed checkpoints only: a directory without a manifest is a save that never finished.
    An unreadable manifest is listed as such (and warned about) instead of hiding the rest.
    A URL that is no run fails (exit 2), so a script can tell a typo from an empty run; a
    checkpoint given for its run is listed alone, with a note."""
    if args.tiers:
        return _ls_tiers(args)
    found = list_checkpoints(args.run, args.storage_options, include_unreadable=True)
    kind = "run" if found else what_is_at(args.run, args.storage_options)
    if kind == "missing":
        raise missing(args.run)
    if kind == "dcp":
        raise FormatError(f"{args.run} is a plain DCP checkpoint (torch.distributed.checkpoint's "
                          ".metadata), not a ckptturbo run")
    if kind == "checkpoint":
        url = args.run.rstrip("/")
        m = read_manifest(url, args.storage_options)
        found = [CheckpointInfo(url.rsplit("/", 1)[-1], url, m.created, m.total_bytes,
                                m.unique_bytes, len(m.items))]
        print(f"ckptturbo: {url} is a checkpoint, not a run; `ckptturbo ls "
              f"{url.rsplit('/', 1)[0]}` lists its run", file=sys.stderr)
    if args.json:
        print(json.dumps([ls_record(c) for c in found], indent=2))
        return EXIT_OK
    if not found:
        print(f"no committed checkpoints under {args.run}", file=sys.stderr)
        return EXIT_OK
    print_table(["NAME", "CREATED", "SIZE", "STORED", "ITEMS"],
                [[c.name, "UNREADABLE", "-", "-", "-"] if c.error else
                 [c.name, iso_time(c.created), human(c.total_bytes), human(c.unique_bytes), c.items]
                 for c in found], right={2, 3, 4})
    return EXIT_OK


def ls_record(c: CheckpointInfo, **extra: Any) -> dict[str, Any]:
    """One checkpoint as ``ls --json`` prints it (``extra`` adds or replaces fields)."""
    return {"name": c.name, "url": c.url, "created": c.created, "created_iso": iso_time(c.created),
            "total_bytes": c.total_bytes, "unique_bytes": c.unique_bytes, "items": c.items,
            "error": c.error, **extra}


def _ls_tiers(args: argparse.Namespace) -> int:
    """Every checkpoint of the run in this node's memory tier or the durable store, and
    which of the two holds it (a checkpoint only in memory is not durable)."""
    run = args.run.rstrip("/")
    tiers = Tiers(memory=args.memory, node=args.node)
    found = list_tiered(run, args.storage_options, tiers, include_unreadable=True)
    if not found and what_is_at(run, args.storage_options) == "missing":
        raise missing(run)  # a typo, not an empty run: as plain `ls` says
    if args.json:
        print(json.dumps([ls_record(c, tiers=list(c.tiers)) for c in found], indent=2))
        return EXIT_OK
    if not found:
        print(f"no committed checkpoints under {run} nor in its memory tier "
              f"{tiers.memory_run(run)}", file=sys.stderr)
        return EXIT_OK
    print_table(["NAME", "CREATED", "SIZE", "STORED", "ITEMS", "TIERS"],
                [[c.name, iso_time(c.created), human(c.total_bytes), human(c.unique_bytes),
                  c.items, ",".join(c.tiers)] for c in found], right={2, 3, 4})
    return EXIT_OK


# --- inspect -------------------------------------------------------------------------

def describe(url: str, manifest: Manifest) -> dict[str, Any]:
    """Everything inspect shows, as one JSON-able document (the table is a view of it)."""
    tensors, objects = [], []
    for fqn, item in sorted(manifest.items.items()):
        nbytes = sum(s.nbytes for s in item.shards)
        if item.kind == "tensor":
            tensors.append({"name": fqn, "dtype": item.dtype_name, "shape": list(item.size or ()),
                            "bytes": nbytes, "shards": len(item.shards),
                            "chunks": len(item_chunks(item)),
                            "deltas": sum(len(s.deltas) for s in item.shards)})
        else:
            objects.append({"name": fqn, "bytes": nbytes})
    total, unique = manifest.total_bytes, manifest.unique_bytes
    stats = manifest.stats
    return {"url": url, "created": manifest.created, "created_iso": iso_time(manifest.created),
            "world_size": stats.get("world_size"), "tensors": tensors, "objects": objects,
            "total_bytes": total, "unique_bytes": unique, "chunks": len(manifest.chunks),
            "dedup_ratio": round(total / unique, 4) if unique else 1.0,
            "bytes_written": stats.get("bytes_written"), "bytes_reused": stats.get("bytes_reused")}


def cmd_inspect(args: argparse.Namespace) -> int:
    """Shapes and dtypes answer "what is in it"; the byte totals answer "what did it cost"."""
    info = describe(args.ckpt, read_manifest(args.ckpt, args.storage_options))
    if args.json:
        print(json.dumps(info, indent=2))
        return EXIT_OK
    print(f"checkpoint {info['url']}  created {info['created_iso']}  "
          f"world size {info['world_size']}")
    if info["tensors"]:
        print(f"\ntensors ({len(info['tensors'])}):")
        print_table(["NAME", "DTYPE", "SHAPE", "BYTES", "SHARDS", "CHUNKS"],
                    [[t["name"], t["dtype"], "x".join(map(str, t["shape"])) or "()",
                      human(t["bytes"]), t["shards"], t["chunks"]] for t in info["tensors"]],
                    right={3, 4, 5})
    if info["objects"]:
        print(f"\nobjects ({len(info['objects'])}):")
        print_table(["NAME", "BYTES"], [[o["name"], human(o["bytes"])] for o in info["objects"]],
                    right={1})
    print(f"\ntotal bytes:         {human(info['total_bytes'])} ({info['total_bytes']})")
    print(f"unique chunk bytes:  {human(info['unique_bytes'])} in {info['chunks']} chunks "
          f"(dedup ratio {info['dedup_ratio']:.2f}x)")
    if info["bytes_written"] is not None:
        print(f"this save wrote:     {human(info['bytes_written'])} new, "
              f"{human(info['bytes_reused'] or 0)} reused from earlier saves")
    return EXIT_OK


# --- verify --------------------------------------------------------------------------

def cmd_verify(args: argparse.Namespace) -> int:
    """Re-hash every chunk: bit rot, a truncated upload or an over-eager cleanup shows here,
    not in the middle of a training restart."""
    manifest = read_manifest(args.ckpt, args.storage_options)
    location = Location.for_manifest(args.ckpt, args.storage_options, manifest)
    bar, lock = progress(manifest.unique_bytes, "verify"), threading.Lock()

    def check(entry: tuple[str, int]) -> tuple[str, str | None]:
        cid, size = entry
        problem = stored_chunk_problem(location, cid, size)
        with lock:
            bar.update(size)
        return cid, problem

    try:
        results = location.chunk_store.map(check, sorted(manifest.chunks.items()))
    finally:
        bar.close()
    bad = [(cid, problem) for cid, problem in results if problem]
    users = chunk_users(manifest)
    for cid, problem in bad:
        print(f"chunk {cid} ({human(manifest.chunks[cid])}) is {problem}; "
              f"used by: {names_preview(users.get(cid, []))}")
    if bad:
        missing = sum(p == "missing" for _, p in bad)
        print(f"FAILED {args.ckpt}: {missing} missing, {len(bad) - missing} corrupt "
              f"of {len(manifest.chunks)} chunks")
        return EXIT_MISMATCH
    print(f"OK {args.ckpt}: {len(manifest.chunks)} chunks, {human(manifest.unique_bytes)} verified")
    return EXIT_OK


# --- gc and rm -----------------------------------------------------------------------

def cmd_gc(args: argparse.Namespace) -> int:
    """Chunks are shared between checkpoints, so space is freed by a run-wide sweep, not by rm."""
    run, options = args.run, args.storage_options
    if args.tier == "memory":  # this node's memory tier of the run: a run of its own
        tiers = Tiers(memory=args.memory, node=args.node)
        run, options = tiers.memory_run(args.run.rstrip("/")), None
    report = collect_garbage(run, options, dry_run=args.dry_run, grace_seconds=args.grace)
    verb = "would delete" if report.dry_run else "deleted"
    print(f"gc {run}: {report.referenced} chunks referenced by committed checkpoints; "
          f"{verb} {report.deleted} unreferenced chunks ({human(report.deleted_bytes)})")
    if report.kept_recent:
        print(f"kept {report.kept_recent} unreferenced chunks younger than the "
              f"{args.grace:g}s grace period")
    return EXIT_OK


def cmd_rm(args: argparse.Namespace) -> int:
    """Removing the manifest is the atomic delete; chunks may be shared, so gc frees them
    (a self-contained checkpoint's chunks go with it)."""
    if delete_checkpoint(args.ckpt, args.storage_options):
        print(f"deleted {args.ckpt} and its chunks")
        return EXIT_OK
    run = parent_url(args.ckpt)
    print(f"deleted {args.ckpt}; run `ckptturbo gc {run}` to free chunks no other checkpoint uses")
    return EXIT_OK


# --- export --------------------------------------------------------------------------

def cmd_export(args: argparse.Namespace) -> int:
    """Other tools (inference servers, converters) read safetensors or plain DCP, not chunks."""
    # imports torch: only this command needs it
    from .export import export_dcp, export_format, export_safetensors, safetensors_target

    if export_format(args.dest, args.format) == "safetensors":
        tensors, files = export_safetensors(args.ckpt, args.dest, args.storage_options,
                                            max_shard_size=args.max_shard_size)
        where = safetensors_target(args.dest)[0]
        print(f"exported {tensors} tensors of {args.ckpt} to {where} as "
              f"{', '.join(files) if len(files) <= 3 else f'{len(files)} safetensors files'}")
    else:
        if args.max_shard_size is not None:
            log.warning("--max-shard-size applies to --format safetensors only; ignored")
        items = export_dcp(args.ckpt, args.dest, args.storage_options,
                           allow_pickle=args.allow_pickle)
        print(f"exported {items} items of {args.ckpt} to {args.dest.removeprefix('file://')} "
              "as a DCP checkpoint")
    return EXIT_OK


# --- bench ---------------------------------------------------------------------------

def cmd_bench(args: argparse.Namespace) -> int:
    """The fastest streams x request size depends on the store and the network; measure it."""
    from .stream.calibrate import calibrate
    from .stream.profiles import save_profile

    try:
        result = calibrate(args.calibrate, args.storage_options, streams=args.streams,
                           chunk_sizes=args.chunk_sizes, sample_bytes=args.sample_size)
    except StorageError as exc:
        if isinstance(exc.__cause__, IsADirectoryError):
            raise CheckpointNotFound(f"{args.calibrate} is a directory without *.safetensors "
                                     "files: give a file, or a directory holding some") from exc
        raise
    sampled, biggest = result["sample_bytes"], max(args.chunk_sizes)
    if sampled < biggest:
        raise FormatError(f"{result['object']} holds {sampled} bytes, less than one request of "
                          f"{human(biggest)}: too small to tell the settings apart; calibrate on "
                          "a file of at least --sample-size bytes (nothing was saved)")
    if sampled < args.sample_size:
        log.warning("%s holds %s, less than --sample-size %s: the timings are noisier",
                    result["object"], human(sampled), human(args.sample_size))
    if args.save:
        result["saved_to"] = str(save_profile(result["endpoint"], result))
    print(f"calibrated {result['object']} ({human(result['sample_bytes'])} read per setting)")
    print_table(["STREAMS", "CHUNK", "GB/S"],
                [[r["streams"], human(r["chunk_size"]), f"{r['gbps']:.3f}"]
                 for r in result["results"]], right={0, 1, 2})
    print(f"best for {result['endpoint']}: streams={result['streams']} "
          f"chunk_size={human(result['chunk_size'])} ({result['gbps']:.3f} GB/s)")
    if "saved_to" in result:
        print(f"saved to {result['saved_to']}; the streamer uses it for this endpoint")
    return EXIT_OK


# --- argument parsing ----------------------------------------------------------------

def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _size_list(text: str) -> list[int]:
    return [parse_size(v) for v in text.split(",") if v.strip()]


def _common(suppress: bool) -> argparse.ArgumentParser:
    """Options every subcommand takes, before or after its name.

    The copy attached to subcommands defaults to SUPPRESS so that ``ckptturbo -v ls run``
    is not undone by the subparser's own default.
    """
    default: Any = argparse.SUPPRESS if suppress else None
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--storage-options", type=parse_storage_options, default=default,
                        metavar="JSON", help="fsspec options as a JSON object, e.g. "
                        '\'{"client_kwargs": {"endpoint_url": "http://host:8333"}}\'; '
                        "S3 credentials are also read from the usual AWS_* variables")
    parser.add_argument("-v", "--verbose", action="count",
                        default=argparse.SUPPRESS if suppress else 0,
                        help="log progress (-v) or everything (-vv)")
    return parser


def _memory_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory", metavar="DIR", help="the memory tier's directory (default: "
                   "$CKPTTURBO_MEMORY_DIR, else /dev/shm/ckptturbo)")
    p.add_argument("--node", help="the node whose memory tier to use (default: $CKPTTURBO_NODE, "
                   "else the host name)")


def _export_options(p: argparse.ArgumentParser) -> None:
    """The arguments of ``ckptturbo export``."""
    p.add_argument("ckpt", help="the checkpoint URL")
    p.add_argument("dest", help="a .safetensors file, or a directory (a local path for dcp; "
                   "any fsspec URL for safetensors)")
    p.add_argument("--format", choices=["dcp", "safetensors"],
                   help="what to write (default: safetensors for a dest named *.safetensors; "
                   "required otherwise)")
    p.add_argument("--max-shard-size", type=parse_size, metavar="SIZE",
                   help="safetensors: split into files of at most SIZE (e.g. 5GB), HF style")
    p.add_argument("--allow-pickle", action="store_true",
                   help="dcp: also export non-tensor objects (unpickles them; trusted "
                   "checkpoints only)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckptturbo", parents=[_common(False)],
        description="Inspect, verify, clean up and export ckptturbo checkpoints.")
    parser.add_argument("--version", action="version", version=f"ckptturbo {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = [_common(True)]

    def add(name: str, fn: Callable[[argparse.Namespace], int],
            help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=common, help=help_, description=help_)
        p.set_defaults(func=fn)
        return p

    p = add("ls", cmd_ls, "list the committed checkpoints of a run")
    p.add_argument("run", help="the run URL (the parent of the checkpoints)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--tiers", action="store_true",
                   help="also list this node's memory tier of the run, and say which tiers "
                   "hold each")
    _memory_options(p)

    p = add("inspect", cmd_inspect, "show the tensors, objects and storage use of a checkpoint")
    p.add_argument("ckpt", help="the checkpoint URL")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = add("verify", cmd_verify, "re-hash every chunk of a checkpoint (exit 1 if any is bad)")
    p.add_argument("ckpt", help="the checkpoint URL")

    p = add("gc", cmd_gc, "delete chunks that no committed checkpoint of the run uses")
    p.add_argument("run", help="the run URL (the parent of the checkpoints)")
    p.add_argument("--dry-run", action="store_true",
                   help="report what would be deleted, delete nothing")
    p.add_argument("--grace", type=float, default=0.0, metavar="SECONDS",
                   help="keep unreferenced chunks younger than this (default 0)")
    p.add_argument("--tier", choices=["durable", "memory"], default="durable",
                   help="collect the run's durable store (default) or this node's memory "
                   "tier of it")
    _memory_options(p)

    p = add("rm", cmd_rm, "delete a checkpoint (its manifest); gc frees its chunks")
    p.add_argument("ckpt", help="the checkpoint URL")

    _export_options(add("export", cmd_export,
                        "write a plain DCP or safetensors copy of a checkpoint"))

    p = add("bench", cmd_bench, "measure the fastest streaming settings for a store")
    p.add_argument("--calibrate", required=True, metavar="URL",
                   help="a safetensors file, or a directory/prefix holding some")
    p.add_argument("--save", action="store_true", help="store the best settings for the streamer")
    p.add_argument("--streams", type=_int_list, default=[4, 8, 16, 32], metavar="N,N,...",
                   help="parallel request counts to try (default 4,8,16,32)")
    p.add_argument("--chunk-sizes", type=_size_list, default=[4 << 20, 16 << 20, 64 << 20],
                   metavar="SIZE,...", help="request sizes to try (default 4MiB,16MiB,64MiB)")
    p.add_argument("--sample-size", type=parse_size, default=256 << 20, metavar="SIZE",
                   help="bytes read per setting (default 256MiB)")
    return parser


def setup_logging(verbosity: int) -> None:
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    logging.basicConfig(format="ckptturbo: %(levelname)s: %(message)s", level=level)
    logging.getLogger("ckptturbo").setLevel(level)


def main(argv: list[str] | None = None) -> int:
    """Run one command; errors of ours become one line on stderr and exit code 2."""
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    try:
        return args.func(args)
    except BrokenPipeError:
        return _closed_pipe()
    except (CkptTurboError, OSError) as exc:  # OSError: the local side (a path, a disk)
        log.debug("error details", exc_info=True)
        print(f"ckptturbo: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("ckptturbo: interrupted", file=sys.stderr)
        return 130


def _closed_pipe() -> int:
    """The reader of our output went away (``ckptturbo inspect ... | head``): that is not an
    error. Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout without a file descriptor (captured)
        pass
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
