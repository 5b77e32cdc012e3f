"""A damaged ``.idx`` (issue #37): truncated, one pointer flipped in place, the fingerprint
trailer cut and then a pointer flipped, and each other field of the index changed. Every fault
is injected into a real ``.idx`` (the tiny corpus as ``megatron-ext preprocess`` wrote it, or
the same documents written by megatron-core's own ``IndexedDatasetBuilder``); training
start-up and the lookup refuse it with the overlay's one-line message and accept untouched
data of every writer: this preprocess, an earlier one (first trailer version), Megatron's
builder (no trailer)."""

from __future__ import annotations

import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_ext.common.features import FeatureError
from megatron_ext.common.records import pair
from megatron_ext.common.records.pair import HEADER, IndexDamaged, PairError, check_pair
from megatron_ext.data.adapter import DataCheckFeature
from megatron_ext.lookup import cli
from tests.support.faults import fault
from tests.support.harness import launch

FLIPPED = 100  # the sequence whose pointer is flipped
FLIP = 1 << 5  # the bit flipped: the sequence would start 32 bytes off
TRUNCATED = 3000  # bytes, as the on-call engineer found it
FIX = "Rerun the preprocessing of this prefix"


@pytest.fixture(scope="module")
def corpus(data_args) -> str:
    """The tiny corpus as `megatron-ext preprocess` wrote it (with its fingerprint trailer)."""
    return data_args[data_args.index("--data-path") + 1]


def _copy(source: str, prefix: Path) -> str:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    for suffix in (".bin", ".idx"):
        shutil.copy(source + suffix, f"{prefix}{suffix}")
    return str(prefix)


def _counts(prefix: str) -> tuple[int, int, int]:
    """(sequences, document indices, bytes of header and arrays), from the header."""
    with open(f"{prefix}.idx", "rb") as handle:
        _, _, _, sequences, documents = HEADER.unpack(handle.read(HEADER.size))
    return sequences, documents, HEADER.size + 12 * sequences + 8 * documents


def _field(prefix: str, offset: int, form: str, change=None) -> int:
    """The value at ``offset`` of the ``.idx``; with ``change``, rewritten in place (same size)."""
    with open(f"{prefix}.idx", "r+b") as handle:
        handle.seek(offset)
        (value,) = struct.unpack(form, handle.read(struct.calcsize(form)))
        if change is not None:
            handle.seek(offset)
            handle.write(struct.pack(form, change(value)))
    return value


def _pointer_at(prefix: str, sequence: int) -> int:
    return HEADER.size + 4 * _counts(prefix)[0] + 8 * sequence


def _flip_pointer(prefix: str) -> tuple[int, int]:
    """XOR one bit of one sequence pointer, in place; (flipped, right) values."""
    right = _field(prefix, _pointer_at(prefix, FLIPPED), "<q", lambda p: p ^ FLIP)
    return right ^ FLIP, right


def _truncate(prefix: str, size: int = TRUNCATED) -> None:
    with open(f"{prefix}.idx", "r+b") as handle:
        handle.truncate(size)


def _cut_trailer(prefix: str) -> None:
    _truncate(prefix, _counts(prefix)[2])


def _megatron_built(source: str, prefix: Path) -> str:
    """The same documents written by megatron-core's IndexedDatasetBuilder: no trailer."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    read = IndexedDataset(source, multimodal=False, mmap=True)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=read.index.dtype)
    for sequence in range(len(read)):
        document = read.get(sequence)
        builder.add_document(document, [len(document)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def _first_trailer_version(source: str, prefix: Path) -> str:
    """The pair as a preprocess before the ``.idx`` digest left it: the .bin fingerprint only."""
    _copy(source, prefix)
    _cut_trailer(str(prefix))
    size, digest = pair.fingerprint(f"{prefix}.bin")
    with open(f"{prefix}.idx", "ab") as handle:
        handle.write(struct.pack("<8sQ32s", b"MXEXPAIR", size, digest))
    return str(prefix)


def _truncated_message(prefix: str, counts: tuple[int, int, int]) -> str:
    sequences, documents, body = counts
    return (
        f"{prefix}.idx is damaged: it has {TRUNCATED} bytes but its header's {sequences} "
        f"sequences and {documents} document indices need {body} (truncated"
    )


def _flipped_message(prefix: str, values: tuple[int, int]) -> str:
    return (
        f"{prefix}.idx is damaged: sequence {FLIPPED} points at byte {values[0]} of the .bin, "
        f"but the lengths before it end at byte {values[1]} (a pointer or length changed)"
    )


def _namespace(prefixes: list[str], rank: int = 0) -> SimpleNamespace:
    """The flags the data check reads, as Megatron's parser leaves them."""
    return SimpleNamespace(
        mock_data=False,
        data_path=prefixes,
        train_data_path=None,
        valid_data_path=None,
        test_data_path=None,
        data_args_path=None,
        per_split_data_args_path=None,
        split="100,0,0",
        seq_length=64,
        rank=rank,
    )


@pytest.mark.e2e
@fault(
    "a `.idx` truncated to 3000 bytes; one sequence pointer flipped in place (same size); the "
    "fingerprint trailer cut off, then a pointer flipped",
    "training refuses at start-up (exit 1, before distributed init, no traceback) in one line "
    "naming each `.idx`, what is wrong (its size against its header's counts; the sequence, "
    "its pointer and where the lengths before it end) and the fix; was: Megatron's "
    "traceback, and training on wrong tokens. Untouched pairs from this preprocess, an "
    "earlier one (first trailer version) and Megatron's IndexedDatasetBuilder (no trailer) "
    "pass the same check",
    area="training start-up",
)
def test_a_damaged_idx_is_refused_at_training_start_up(data_args, corpus, tmp_path) -> None:
    counts = _counts(corpus)
    damaged = {name: _copy(corpus, tmp_path / name / "d") for name in ("truncated", "flip", "cut")}
    _truncate(damaged["truncated"])
    flipped = _flip_pointer(damaged["flip"])
    _cut_trailer(damaged["cut"])
    assert _flip_pointer(damaged["cut"]) == flipped
    flags = list(data_args)
    flags[flags.index("--data-path") + 1 : flags.index("--data-path") + 2] = damaged.values()
    flags[flags.index("--data-cache-path") + 1] = str(tmp_path / "cache")
    run = launch(tmp_path / "run", flags, timeout=300, sample_log=False)
    assert run.returncode == 1, run.log[-3000:]
    assert run.exits().get(0, {}).get("exit_code") == 1, run.log[-3000:]  # the rank's choice
    # The rank's own output; torchrun then reports the failed child with a traceback of its
    # own launcher (torch/distributed/run.py), as for any rank that exits non-zero.
    rank = run.log[: run.log.index("failed (exitcode: 1) local_rank: 0")]
    expected = [
        _truncated_message(damaged["truncated"], counts),
        _flipped_message(damaged["flip"], flipped),
        _flipped_message(damaged["cut"], flipped),
    ]
    line = next(line for line in rank.splitlines() if expected[0] in line)
    assert all(message in line for message in expected), rank[-3000:]  # one line, all three
    assert line.startswith("megatron-ext: ") and FIX in line
    assert "initializing torch distributed" not in rank  # refused before init
    assert "Traceback" not in rank, rank[-3000:]
    # Every rank runs the check; the others point at rank 0's message.
    with pytest.raises(FeatureError, match="rank 0 printed why"):
        DataCheckFeature().validate(_namespace(list(damaged.values()), rank=1))

    accepted = [
        corpus,
        _first_trailer_version(corpus, tmp_path / "v1" / "d"),
        _megatron_built(corpus, tmp_path / "megatron" / "d"),
    ]
    assert Path(f"{accepted[2]}.idx").stat().st_size == counts[2]  # no trailer
    DataCheckFeature().validate(_namespace(accepted))


@fault(
    "the same faults under `lookup` (caches built on the untouched data), and a pointer "
    "flipped in a `.idx` that Megatron's IndexedDatasetBuilder wrote (no trailer); "
    "`lookup --rebuild-caches` over a truncated `.idx`",
    "refused (exit 1) with the start-up check's message instead of 'caches match today's "
    ".bin/.idx' over wrong tokens or a numpy message; the rebuild refused before Megatron's "
    "builder runs; untouched pairs (this preprocess, Megatron's builder) answered",
    area="lookup",
)
def test_a_damaged_idx_is_refused_by_lookup(data_args, corpus, tmp_path, capsys) -> None:
    counts = _counts(corpus)
    ours = _copy(corpus, tmp_path / "data" / "ours")
    megatron = _megatron_built(corpus, tmp_path / "data" / "megatron")
    flags = list(data_args)
    flags[flags.index("--data-path") + 1 : flags.index("--data-path") + 2] = [ours, megatron]
    flags[flags.index("--data-cache-path") + 1] = str(tmp_path / "cache")
    flags += ["--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4"]
    flags += ["--train-iters", "10", "--seed", "3", "--data-parallel-size", "1"]
    flags += ["--iteration", "3"]
    assert cli.main([*flags, "--rebuild-caches"]) == 0, capsys.readouterr().err
    assert "caches match today's .bin/.idx" in capsys.readouterr().out

    def refused(message: str) -> str:
        assert cli.main(flags) == 1
        err = capsys.readouterr().err
        assert err.startswith("megatron-ext lookup: refused: ") and message in err, err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1
        return err

    saved = {prefix: Path(f"{prefix}.idx").read_bytes() for prefix in (ours, megatron)}
    for prefix in (ours, megatron):
        _truncate(prefix)
        refused(_truncated_message(prefix, counts))
        Path(f"{prefix}.idx").write_bytes(saved[prefix])
        refused(_flipped_message(prefix, _flip_pointer(prefix)))
        Path(f"{prefix}.idx").write_bytes(saved[prefix])
    _cut_trailer(ours)
    refused(_flipped_message(ours, _flip_pointer(ours)))
    Path(f"{ours}.idx").write_bytes(saved[ours])
    assert cli.main(flags) == 0  # both untouched pairs answered again
    assert "caches match today's .bin/.idx" in capsys.readouterr().out

    shutil.rmtree(tmp_path / "cache")
    _truncate(ours)
    assert cli.main([*flags, "--rebuild-caches"]) == 1
    err = capsys.readouterr().err
    assert _truncated_message(ours, counts) in err and "no cache was rebuilt" in err, err
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.npy"))


def _append(path: str, data: bytes) -> None:
    with open(path, "ab") as handle:
        handle.write(data)


def _edits(prefix: str) -> dict[str, tuple[Callable[[], object], str]]:
    """Each other field of the ``.idx`` changed in place: (edit, the refusal's words)."""
    sequences, documents, _ = _counts(prefix)
    lengths, pointers = HEADER.size, HEADER.size + 4 * sequences
    indices = pointers + 8 * sequences
    code = _field(prefix, 17, "<B")
    itemsize = pair.ITEM_SIZES[code]
    last = _field(prefix, lengths + 4 * (sequences - 1), "<i")
    end = _field(prefix, pointers + 8 * (sequences - 1), "<q") + last * itemsize

    def move_boundary() -> None:
        """Document 6 one token longer, 7 one shorter: pointers and lengths still agree."""
        _field(prefix, lengths + 4 * 6, "<i", lambda n: n + 1)
        _field(prefix, lengths + 4 * 7, "<i", lambda n: n - 1)
        _field(prefix, pointers + 8 * 7, "<q", lambda p: p + itemsize)

    def shorten_bin() -> None:
        _cut_trailer(prefix)
        with open(f"{prefix}.bin", "r+b") as handle:
            handle.truncate(end - itemsize)

    return {
        "negative length": (
            lambda: _field(prefix, lengths + 4 * 3, "<i", lambda n: -n),
            "sequence 3 has length -",
        ),
        "last length": (
            lambda: _field(prefix, lengths + 4 * (sequences - 1), "<i", lambda n: n + 1),
            f"describes {end + itemsize} bytes of tokens but {prefix}.bin has {end}",
        ),
        "document index back": (
            lambda: _field(prefix, indices + 8 * 5, "<q", lambda i: i + 2),
            "document index 6 is 6, below the one before it (7)",
        ),
        "document index start": (
            lambda: _field(prefix, indices, "<q", lambda i: 1),
            "its document indices start at 1, not 0",
        ),
        "document index end": (
            lambda: _field(prefix, indices + 8 * (documents - 1), "<q", lambda i: i - 1),
            f"its document indices end at sequence {sequences - 1}, not at its {sequences}",
        ),
        "magic": (lambda: _field(prefix, 0, "<B", lambda b: b ^ 1), "index magic MMIDIDX"),
        "version": (lambda: _field(prefix, 9, "<Q", lambda v: 2), "index version 2, not 1"),
        "dtype code": (lambda: _field(prefix, 17, "<B", lambda c: 0), "dtype code 0 is none"),
        "sequence count": (
            lambda: _field(prefix, 18, "<Q", lambda n: n + 10),  # 120 bytes: past a trailer
            f"its header's {sequences + 10} sequences and {documents} document indices need",
        ),
        "one byte cut": (
            lambda: _truncate(prefix, Path(f"{prefix}.idx").stat().st_size - 1),
            "are not megatron-ext's fingerprint trailer",
        ),
        "one byte appended": (
            lambda: _append(f"{prefix}.idx", b"\0"),
            "are not megatron-ext's fingerprint trailer",
        ),
        "no trailer, .bin one token short": (
            shorten_bin,
            f"describes {end} bytes of tokens but {prefix}.bin has {end - itemsize}",
        ),
        "boundary moved": (move_boundary, "their SHA-256 differs from the one in its trailer"),
        "dtype of the same width": (
            lambda: _field(prefix, 17, "<B", lambda c: {3: 8, 8: 3, 4: 7, 7: 4}[c]),
            "their SHA-256 differs from the one in its trailer",
        ),
    }


@fault(
    "each other field of a real `.idx` changed in place: a negative or a last length, a "
    "document index stepping back, not starting at 0 or not ending at the sequence count, the "
    "header's magic, version, dtype code or sequence count, 1 byte cut or appended; a "
    "trailer-less `.idx` beside a `.bin` one token short; a document boundary moved "
    "consistently (two lengths and a pointer), a dtype code swapped for one of the same "
    "width; checked in chunks of 7 entries (every chunk edge)",
    "refused by the check start-up and lookup run, in one line naming the field, entry and "
    "values; the consistent edits only where the trailer records the `.idx`'s SHA-256 (this "
    "preprocess): with the trailer cut, or in Megatron's own `.idx`, nothing records them "
    "and they pass",
    area="training start-up",
)
def test_every_field_of_the_idx_is_checked(corpus, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(pair, "CHUNK", 7)  # the corpus's 400 sequences span 58 chunks
    template = _copy(corpus, tmp_path / "template" / "d")
    check_pair(template)
    for name in _edits(template):
        prefix = _copy(template, tmp_path / name.replace(" ", "-").replace(",", "") / "d")
        edit, message = _edits(prefix)[name]
        edit()
        with pytest.raises(PairError) as refused:
            check_pair(prefix)
        assert message in str(refused.value), (name, str(refused.value))
        assert "\n" not in str(refused.value) and FIX in str(refused.value)
        if name in ("boundary moved", "dtype of the same width"):
            assert isinstance(refused.value, IndexDamaged)
            _cut_trailer(prefix)
            check_pair(prefix)  # structurally sound: only the recorded digest knew
