"""``megatron-ext blocklist apply``: remove the raw records a blocklist names from the corpus
shards, writing filtered copies (never in place) and counting what was removed.

    megatron-ext lookup --from-checkpoint ckpt/ --iteration 137000 --worst 8 \\
        --emit-blocklist bad.jsonl
    megatron-ext blocklist apply --blocklist bad.jsonl --out-dir /data/filtered

Before anything is written, every named shard must still be the one preprocessed (size and
sampled fingerprint) and every named line (Parquet: row) must hold its record. Lines are
counted as ``preprocess`` counts them: 1-based, blank lines included (and kept).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from megatron_ext.common.errors import Refusal, UsageError, report
from megatron_ext.common.io import atomic_write, check_writable
from megatron_ext.common.records.pair import fingerprint
from megatron_ext.data.shards import located, write_without

PROG = "megatron-ext blocklist"
_SOURCE_KEYS = frozenset({"file", "file_size", "file_fingerprint", "byte", "line"})


class BlocklistError(Refusal):
    """A blocklist that cannot be applied exactly; the message names the entry or shard."""


@dataclass
class Shard:
    """One raw shard and the records to remove from it (line -> (byte, id key, id))."""

    path: Path
    recorded: str  # the path the sidecar recorded (before --data-root)
    size: int
    fingerprint: str
    lines: dict[int, tuple[int, str | None, str | None]] = field(default_factory=dict)
    parquet: bool = False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    apply = commands.add_parser("apply", help="write the shards without the blocked records")
    apply.add_argument(
        "--blocklist",
        nargs="+",
        required=True,
        type=Path,
        metavar="FILE.jsonl",
        help="blocklists written by megatron-ext lookup --emit-blocklist",
    )
    apply.add_argument(
        "--out-dir", required=True, type=Path, help="where the filtered shards are written"
    )
    apply.add_argument(
        "--data-root",
        action="append",
        default=[],
        metavar="OLD=NEW",
        help="the shards moved: read the ones recorded under OLD from NEW (repeatable)",
    )
    apply.add_argument("--dry-run", action="store_true", help="check and count, write nothing")
    return parser


def _remap(path: str, roots: list[tuple[str, str]]) -> Path:
    for old, new in roots:
        old = old.rstrip("/")
        if path == old or path.startswith(old + "/"):
            return Path(new.rstrip("/") + path[len(old) :])
    return Path(path)


def _entries(paths: list[Path]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, entry) for every entry of the blocklists."""
    for path in paths:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise BlocklistError(f"{path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise BlocklistError(
                f"{path}: not UTF-8 text; a blocklist is the JSON Lines file that "
                "`megatron-ext lookup --emit-blocklist` writes"
            ) from None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as exc:
                raise BlocklistError(f"{path}:{number}: not JSON ({exc})") from None
            if not isinstance(entry, dict):
                raise BlocklistError(
                    f"{path}:{number}: not a JSON object; a blocklist holds the records of "
                    "`megatron-ext lookup --emit-blocklist`"
                )
            yield f"{path}:{number}", entry


def _shards(paths: list[Path], roots: list[tuple[str, str]]) -> dict[Path, Shard]:
    """The blocklists' records grouped by shard; refuses an entry without a raw record and
    two entries that name one line differently."""
    shards: dict[Path, Shard] = {}
    for where, entry in _entries(paths):
        source = entry.get("source")
        if not source:
            raise BlocklistError(
                f"{where}: document {entry.get('document')} of {entry.get('dataset_path')} names "
                "no raw record (its dataset had no provenance sidecar). Write one with "
                "`megatron-ext provenance rebuild`, emit the blocklist again, then apply it"
            )
        fields = set(source) if isinstance(source, dict) else set()
        if missing := _SOURCE_KEYS - fields:
            raise BlocklistError(
                f"{where}: its source lacks {', '.join(sorted(missing))}: not a raw record of "
                "`megatron-ext lookup --emit-blocklist`; emit the blocklist again"
            )
        path = _remap(source["file"], roots)
        shard = shards.setdefault(
            path,
            Shard(
                path,
                source["file"],
                source["file_size"],
                source["file_fingerprint"],
                parquet=source.get("format") == "parquet",
            ),
        )
        if (shard.size, shard.fingerprint) != (source["file_size"], source["file_fingerprint"]):
            raise BlocklistError(
                f"{where}: {source['file']} is recorded with two different contents by the "
                "blocklists (two preprocessings of a changed shard); apply them one at a time"
            )
        record = (source["byte"], source.get("id_key"), source.get("id"))
        if shard.lines.setdefault(source["line"], record) != record:
            raise BlocklistError(
                f"{where}: line {source['line']} of {source['file']} is named with another byte "
                f"offset or id ({record}) than before ({shard.lines[source['line']]})"
            )
    return shards


def _check_record(handle: BinaryIO, shard: Shard, line: int) -> None:
    """The line starts at its recorded byte and, with an id, holds that record."""
    byte, id_key, record_id = shard.lines[line]
    handle.seek(max(0, byte - 1))
    if byte and handle.read(1) != b"\n":
        raise BlocklistError(f"{shard.path}: no line starts at byte {byte} (line {line})")
    text = handle.readline()
    if record_id is None or id_key is None:
        return
    try:
        found = json.loads(text).get(id_key)
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        found = None
    if found is None or str(found) != record_id:
        raise _other_record(f"{shard.path}:{line}", id_key, found, record_id)


def _other_record(where: str, key: str, found: Any, record_id: str) -> BlocklistError:
    return BlocklistError(
        f"{where} holds the record with {key} {found!r}, not the blocked {record_id!r}: the "
        "shard is not the one the sidecar describes; nothing was written"
    )


def _check(shard: Shard) -> None:
    """The shard is the one preprocessed (size, fingerprint) and holds each named record."""
    if not shard.path.is_file():
        moved = "" if shard.path != Path(shard.recorded) else " (moved? map it with --data-root)"
        raise BlocklistError(f"shard {shard.path} not found{moved}; nothing was written")
    size, digest = fingerprint(shard.path)
    if (size, digest.hex()) != (shard.size, shard.fingerprint):
        raise BlocklistError(
            f"shard {shard.path} is not the one that was preprocessed ({size} bytes, recorded "
            f"{shard.size}, or its fingerprint differs): its lines may hold other records now. "
            "Apply the blocklist to the shard as it was, or preprocess again and redo the "
            "lookup; nothing was written"
        )
    if shard.parquet:
        _check_rows(shard)
        return
    with shard.path.open("rb") as handle:
        for line in sorted(shard.lines):
            _check_record(handle, shard, line)


def _check_rows(shard: Shard) -> None:
    """Each named Parquet row is in its recorded row group and, with an id, holds it."""
    id_key = next((key for _, key, _ in shard.lines.values() if key), None)
    found = located(shard.path, sorted(shard.lines), id_key)
    for number, (group, key, record_id) in sorted(shard.lines.items()):
        if number not in found or found[number][0] != group:
            raise BlocklistError(
                f"{shard.path}: row {number - 1} is not in row group {group}; nothing was written"
            )
        if record_id is not None and key is not None and str(found[number][1]) != record_id:
            raise _other_record(f"{shard.path} row {number - 1}", key, found[number][1], record_id)


def _filter(shard: Shard, out: BinaryIO | None) -> tuple[int, int]:
    """Copy the shard's lines except the named ones to ``out`` (None: count only); (kept
    records, removed records), blank lines kept and not counted."""
    if shard.parquet:
        return write_without(shard.path, set(shard.lines), out)
    kept = removed = offset = 0
    with shard.path.open("rb") as handle:
        for number, line in enumerate(handle, 1):
            if number in shard.lines:
                if shard.lines[number][0] != offset:
                    raise BlocklistError(
                        f"{shard.path}:{number} starts at byte {offset}, not at "
                        f"the recorded {shard.lines[number][0]}"
                    )
                removed += 1
            else:
                kept += bool(line.strip())
                if out is not None:
                    out.write(line)
            offset += len(line)
    if removed != len(shard.lines):
        raise BlocklistError(f"{shard.path} has fewer lines than the blocklist names")
    return kept, removed


def apply(args: argparse.Namespace) -> int:
    """Check every shard and record, then write the filtered copies; print the counts."""
    if any("=" not in item for item in args.data_root):
        raise UsageError("--data-root takes OLD=NEW")
    roots = [(old, new) for old, _, new in (item.partition("=") for item in args.data_root)]
    shards = _shards(args.blocklist, roots)
    if not shards:
        print(f"{PROG}: the blocklists name no record; nothing to do")
        return 0
    common = Path(os.path.commonpath([str(p.absolute().parent) for p in shards]))
    out_dir = args.out_dir.absolute()
    targets = {path: out_dir / path.absolute().relative_to(common) for path in shards}
    for path, target in targets.items():
        if target == path.absolute() or (target.exists() and target.samefile(path)):
            raise UsageError(
                f"--out-dir {args.out_dir} would overwrite the shard {path}: filtered copies are "
                "never written in place; choose another directory"
            )
    for shard in shards.values():
        _check(shard)
    try:
        if not args.dry_run:
            check_writable(out_dir)
    except OSError as exc:
        raise BlocklistError(
            f"--out-dir {args.out_dir}: cannot write there ({exc.strerror or exc}); choose "
            "another directory; nothing was written"
        ) from None
    total = 0
    for path, shard in sorted(shards.items()):
        counts: list[tuple[int, int]] = []
        if args.dry_run:
            counts.append(_filter(shard, None))
        else:
            atomic_write(targets[path], lambda out, s=shard, c=counts: c.append(_filter(s, out)))
        kept, removed = counts[0]
        total += removed
        listed = ", ".join(map(str, sorted(shard.lines)[:10])) + (", ..." if removed > 10 else "")
        print(
            f"{path} -> {'(dry run)' if args.dry_run else targets[path]}: removed {removed} of "
            f"{kept + removed} records (lines {listed})"
        )
    print(
        f"removed {total} record(s) from {len(shards)} shard(s)"
        + (" (dry run: nothing written)" if args.dry_run else f" into {args.out_dir}")
        + "; shards without a blocked record are unchanged and were not copied"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``megatron-ext blocklist``; refusals print their reason and return 1 (2: usage)."""
    args = build_parser().parse_args(argv)
    try:
        return apply(args)
    except (BlocklistError, UsageError) as exc:
        return report(exc, f"{PROG}: refused")
