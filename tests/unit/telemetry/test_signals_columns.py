"""The plot's column reader (pyarrow) gives exactly the values ``json.loads`` gives, on the
writer's lines, an older writer's, and torn, foreign or corrupted ones."""

from __future__ import annotations

import json
import math
import random
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from megatron_ext.common.io import json_safe
from megatron_ext.common.records import signals
from megatron_ext.common.records.signals import (
    COLUMNS,
    SignalRecord,
    parse_block,
    read_signals,
    replay_records,
)

ODD = [0.1, 1e-308, 5e-324, -2.2250738585072014e-308, 1.7976931348623157e308, 123456789.0]


def _line(record: SignalRecord) -> bytes:  # what the writer writes
    return (json.dumps(record.as_json(), separators=(",", ":"), allow_nan=False) + "\n").encode()


def _old_line(record: SignalRecord) -> bytes:  # an older writer: quoted non-finite values
    return (json.dumps(json_safe(record), separators=(",", ":")) + "\n").encode()


def _records(n: int) -> list[SignalRecord]:
    rng = random.Random(0)
    out = []
    for i in range(1, n + 1):
        value = rng.choice([*ODD, math.nan, math.inf, -math.inf, None, rng.random() * 10])
        out.append(
            SignalRecord(
                iteration=i,
                attempt=1 + i // 50,
                job_id='job "7", rank:0',  # a quote and a colon inside a string
                wall_time=rng.random() * 1e9,
                consumed_samples=1024 * i,
                skipped_samples=0,
                lm_loss=rng.random() * 4 if i % 9 else value,
                max_local_loss=None if i % 5 == 0 else rng.random(),
                max_loss_dp_rank=None if i % 7 == 0 else i % 64,
                grad_norm=value,
                bucket_grad_norms={f"b{j}:layers{j}": rng.random() for j in range(i % 3)},
                lm_loss_by_dataset=(
                    {"web": rng.random(), "code:py": 1.0 if value is None else value}
                    if i % 4
                    else {}
                ),
                tokens_by_dataset={"web": i, "code:py": 2 * i} if i % 4 else {},
                params_norm=rng.choice(ODD),
                lr=rng.random() * 1e-3,
                max_attention_logit=None if i % 2 else 30.0,
                skipped_iter=i % 11 == 0,
            )
        )
    return out


def _expected(record: SignalRecord, name: str) -> float | None:
    value = getattr(record, name)
    return float(value) if value is not None else None


def _check(block, records: list[SignalRecord]) -> None:
    assert len(block) == len(records)
    for name in COLUMNS:
        got, present = block.values[name], block.present[name]
        for row, record in enumerate(records):
            want = _expected(record, name)
            if want is None:
                assert not present[row], (name, row)
            elif math.isnan(want):
                assert present[row] and np.isnan(got[row]), (name, row)
            else:
                assert present[row] and got[row] == want, (name, row, got[row], want)


def test_the_writer_s_lines_take_the_fast_path_and_keep_every_bit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    records = _records(400)
    data = b"".join(_line(r) for r in records)
    monkeypatch.setattr(signals, "_json_block", None)  # the json.loads path: not taken
    block = parse_block(data, 0)
    assert block.slow_lines == 0 and not block.problems
    _check(block, records)


def test_non_finite_values_round_trip_and_an_older_writer_s_strings_still_read(
    tmp_path: Path,
) -> None:
    records = _records(200)
    assert any(b'"non_finite":' in _line(r) for r in records)
    for line in map(_line, records):  # plain JSON: no NaN literal, no quoted number
        json.loads(line, parse_constant=lambda c, line=line: pytest.fail(f"{c} in {line!r}"))
    for make in (_line, _old_line):
        data = b"".join(make(r) for r in records)
        _check(parse_block(data, 0), records)
        (tmp_path / "signals.jsonl").write_bytes(data)
        read = read_signals(tmp_path / "signals.jsonl")
        assert [json.dumps(json_safe(r)) for r in read] == [
            json.dumps(json_safe(r)) for r in records
        ]
    old = parse_block(b"".join(_old_line(r) for r in records), 0)
    assert 0 < old.slow_lines < len(records)  # only the lines that hold a quoted non-finite


def test_torn_foreign_gap_and_reordered_lines_are_parsed_as_json_loads_does() -> None:
    records = _records(60)
    lines = [_line(r) for r in records]
    reordered = json.dumps(dict(reversed(list(records[10].as_json().items()))))
    lines[10] = reordered.encode() + b"\n"  # another key order: still a record, read by pyarrow
    lines.insert(20, b'{"iteration":21,"attempt":1,"job_id":"j","wa\n')  # torn
    lines.insert(30, b'{"gap": {"first_iteration": 5, "last_iteration": 9}}\n')
    lines.insert(40, b'{"step": 3}\n')
    block = parse_block(b"".join(lines), 1000)
    assert block.slow_lines == 3
    assert [p.split(" (")[0] for p in block.problems] == [
        f"byte {1000 + sum(map(len, lines[:20]))}",
        f"byte {1000 + sum(map(len, lines[:40]))}",
    ]
    assert block.gaps == [(29, {"first_iteration": 5, "last_iteration": 9})]
    _check(block, records)


def _sources(block) -> list:
    """Each row's per-source fields as a record holds them (text: NaN == NaN)."""
    rows = range(len(block)) if block.sources is not None else []
    return [json.dumps(json_safe(block.sources.dicts(row))) for row in rows]


def _record_sources(records: list[SignalRecord]) -> list:
    return [json.dumps(json_safe((r.lm_loss_by_dataset, r.tokens_by_dataset))) for r in records]


def test_per_source_fields_are_read_with_the_columns_and_reach_a_replay() -> None:
    records = _records(200)  # a quarter of the lines without per-source fields
    block = parse_block(b"".join(_line(r) for r in records), 0, sources=True)
    assert block.slow_lines == 0
    _check(block, records)  # keys with colons inside the nested objects move no column
    assert _sources(block) == _record_sources(records)
    replayed = replay_records(block, np.arange(len(block)))
    assert [r.tokens_by_dataset for r in replayed] == [r.tokens_by_dataset for r in records]
    assert _record_sources(replayed) == _record_sources(records)


def test_the_same_members_on_every_line_are_read_without_json_loads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run's lines name the same members: pyarrow reads them as a struct column."""
    records = [r for r in _records(300) if r.lm_loss_by_dataset]
    for record in records[::7]:
        record.lm_loss_by_dataset["web"] = math.nan  # null, named in non_finite
    data = b"".join(_line(r) for r in records)
    expected = _record_sources(records)
    monkeypatch.setattr(signals, "_json_block", None)  # the json.loads path: not taken
    block = parse_block(data, 0, sources=True)
    assert _sources(block) == expected
    assert block.sources.has_loss.sum(axis=1).tolist() == [2] * len(records)  # two members each
    one = [r for r in _records(40) if r.lm_loss_by_dataset]
    for record in one:  # a single dataset: one member (what a default run writes)
        record.lm_loss_by_dataset = {"tiny_text_document": record.lm_loss or 1.0}
        record.tokens_by_dataset = {"tiny_text_document": 512}
    block = parse_block(b"".join(_line(r) for r in one), 0, sources=True)
    assert _sources(block) == _record_sources(one)
    records[5].lm_loss_by_dataset = {"web": 1.5}  # a member missing from one line: still pyarrow
    block = parse_block(b"".join(_line(r) for r in records), 0, sources=True)
    assert _sources(block) == _record_sources(records)


def _older(line: bytes) -> bytes:
    """The line without the APPENDED fields, as a writer before them wrote it."""
    raw = json.loads(line)
    for name in signals.APPENDED:
        del raw[name]
    return (json.dumps(raw, separators=(",", ":")) + "\n").encode()


def test_an_older_writer_s_lines_take_the_fast_path_with_the_defaults() -> None:
    records = _records(120)
    for record in records[::3]:
        record.log_z, record.update_skipped = 9.5, True
    data = b"".join(_older(_line(r)) for r in records)
    block = parse_block(data, 0, sources=True)
    assert block.slow_lines == 0 and not block.problems
    for record in records:
        record.log_z, record.update_skipped = None, False
    _check(block, records)
    assert _sources(block) == _record_sources(records)
    # Both shapes in one block (a run upgraded mid-log): each line read as json.loads reads it.
    records[60].log_z, records[61].update_skipped = 2.25, True
    lines = [_older(_line(r)) for r in records[:60]] + [_line(r) for r in records[60:]]
    block = parse_block(b"".join(lines), 0, sources=True)
    assert block.slow_lines == 0 and not block.problems
    _check(block, records)
    assert _sources(block) == _record_sources(records)


def test_the_package_holds_no_c_source_and_reads_without_a_compiler() -> None:
    """The column reader is pyarrow's: nothing to build, nothing compiled in the package."""
    package = Path(signals.__file__).parents[2]
    assert not [p for p in package.rglob("*") if p.suffix in (".c", ".h", ".so", ".pyx")]
    code = "import pyarrow.json, megatron_ext.plot.draw"
    subprocess.run([sys.executable, "-c", code], check=True, env={"CC": "/nonexistent"})


def _line_by_line(data: bytes, names=COLUMNS) -> str:
    """parse_block's outcome, or the error, as text (NaN == NaN); ``reference``: every line
    by json.loads."""
    return _outcome(lambda: signals._json_block(data, 7, {"iteration", "attempt", *names}, True))


def _outcome(parse) -> str:
    try:
        block = parse()
        outcome = (
            {k: v.tolist() for k, v in block.values.items()},
            {k: v.tolist() for k, v in block.present.items()},
            {k: str(v.dtype) for k, v in block.values.items()},
            block.problems,
            block.gaps,
            _sources(block),
        )
    except (ValueError, OverflowError) as exc:
        outcome = (type(exc), str(exc))
    return json.dumps(outcome, default=str)


TOKENS = [  # spellings a value may have in a line: pyarrow takes some, refuses others
    b"1",
    b"-0.0",
    b"1e+16",
    b"1E5",
    b"2.5e-05",
    b"1e400",
    b"-1e-400",
    b"+1",
    b"01",
    b".5",
    b"5.",
    b"1e",
    b"null",
    b"n",
    b"nope",
    b"true",
    b"tru",
    b"truex",
    b"false",
    b'"nan"',
    b'"-Infinity"',
    b'"x"',
    b"nan",
    b"inf",
    b"",
    b"1_0",
    b" 1",
    b"123456789012345678",
    b"1234567890123456789",
    b"-3",
    b"0x10",
    b"1.7976931348623157e308",
    b"4.9406564584124654e-324",
    b"123456789012345678901234",
    b"1234567890123456789012345",
]


def _spelled(line: bytes, name: str, token: bytes) -> bytes:
    key = f'"{name}":'.encode()
    start = line.index(key) + len(key)
    stop = min(i for i in (line.find(b",", start), line.find(b"}", start)) if i >= 0)
    return line[:start] + token + line[stop:]


def _agree(data: bytes) -> None:
    for wanted in (COLUMNS, ("lm_loss", "grad_norm", "lr")):
        fast = _outcome(lambda wanted=wanted: parse_block(data, 7, wanted, sources=True))
        assert fast == _line_by_line(data, wanted), data[:300]


def test_pyarrow_agrees_with_json_loads_on_every_spelling() -> None:
    lines = [_line(r) for r in _records(20)]
    for name in COLUMNS:
        for token in TOKENS:
            _agree(b"".join([*lines[:5], _spelled(lines[5], name, token), *lines[6:]]))


def test_pyarrow_agrees_with_json_loads_on_corrupted_blocks() -> None:
    rng = random.Random(1)
    base = [_line(r) for r in _records(40)]
    for trial in range(400):
        lines = list(base)
        row = rng.randrange(len(lines))
        if trial % 2:  # a byte changed
            line = bytearray(lines[row])
            line[rng.randrange(len(line) - 1)] = rng.choice(b'":,{}n0e-."\n ')
            lines[row] = bytes(line)
        else:  # a line cut
            lines[row] = lines[row][: rng.randrange(1, len(lines[row]))]
        data = b"".join(lines)
        _agree(data if trial % 5 else data[: rng.randrange(1, len(data))])


def _with_loss(tokens: list[bytes]) -> bytes:
    """The writer's lines, each holding one of ``tokens`` as its lm_loss."""
    template = _line(_records(1)[0])
    key = b'"lm_loss":'
    start = template.index(key) + len(key)
    stop = template.index(b",", start)
    return b"".join(template[:start] + t + template[stop:] for t in tokens)


def test_pyarrow_rounds_every_decimal_as_python_float_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same double as ``float()`` for every JSON number, including 17-19 digit decimals
    and halfway cases between two doubles."""
    rng = random.Random(2)
    tokens = []
    for _ in range(20000):
        bits = struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))[0]
        if math.isfinite(bits):
            tokens.append(repr(bits).encode())
        tokens.append(repr(float(np.float32(rng.random() * 10))).encode())
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randrange(1, 20)))
        exponent = rng.randrange(-310, 310)
        sign = rng.choice(["", "-"])
        tokens.append(f"{sign}{digits[0]}.{digits[1:] or '0'}e{exponent}".encode())
        low = rng.random() * 4
        high = math.nextafter(low, math.inf)
        tokens.append(f"{(low + high) / 2:.25g}"[:24].encode())  # at or next to a halfway point
    monkeypatch.setattr(signals, "_json_block", None)  # pyarrow reads every line
    block = parse_block(_with_loss(tokens), 0, ("lm_loss",))
    assert block.present["lm_loss"].all()
    assert block.values["lm_loss"].tolist() == [float(t) for t in tokens]


def test_blocks_parse_on_parallel_threads_with_the_same_results() -> None:
    data = b"".join(_line(r) for r in _records(300))
    expected = parse_block(data, 0)
    with ThreadPoolExecutor(4) as pool:
        blocks = list(pool.map(lambda _: parse_block(data, 0), range(16)))
    for block in blocks:
        for name in COLUMNS:
            assert np.array_equal(block.values[name], expected.values[name], equal_nan=True)
            assert np.array_equal(block.present[name], expected.present[name])
