"""The plot's column parser gives exactly the values ``json.loads`` gives, fast path or not."""

from __future__ import annotations

import json
import math
import random

import numpy as np

from megatron_ext.io import json_safe
from megatron_ext.records.signals import SignalRecord
from megatron_ext.records.signals_columns import (
    COLUMNS,
    parse_block,
    replay_records,
)

ODD = [0.1, 1e-308, 5e-324, -2.2250738585072014e-308, 1.7976931348623157e308, 123456789.0]


def _line(record: SignalRecord) -> bytes:  # what JsonlAppender writes
    return (json.dumps(json_safe(record.as_json()), separators=(",", ":")) + "\n").encode()


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


def test_the_writer_s_lines_take_the_fast_path_and_keep_every_bit() -> None:
    records = _records(400)
    block = parse_block(b"".join(_line(r) for r in records), 0)
    assert block.slow_lines == 0 and not block.problems
    _check(block, records)


def test_torn_foreign_gap_and_reordered_lines_are_parsed_as_json_loads_does() -> None:
    records = _records(60)
    lines = [_line(r) for r in records]
    reordered = json.dumps(dict(reversed(list(json_safe(records[10].as_json()).items()))))
    lines[10] = reordered.encode() + b"\n"  # another writer's key order: still a record
    lines.insert(20, b'{"iteration":21,"attempt":1,"job_id":"j","wa\n')  # torn
    lines.insert(30, b'{"gap": {"first_iteration": 5, "last_iteration": 9}}\n')
    lines.insert(40, b'{"step": 3}\n')
    block = parse_block(b"".join(lines), 1000)
    assert block.slow_lines == 4
    assert [p.split(" (")[0] for p in block.problems] == [
        f"byte {1000 + sum(map(len, lines[:20]))}",
        f"byte {1000 + sum(map(len, lines[:40]))}",
    ]
    assert block.gaps == [(29, {"first_iteration": 5, "last_iteration": 9})]
    _check(block, records)


def test_per_source_fields_are_read_with_the_columns_and_reach_a_replay() -> None:
    records = _records(200)
    block = parse_block(b"".join(_line(r) for r in records), 0, sources=True)
    assert block.slow_lines == 0
    _check(block, records)  # keys with colons inside the nested objects move no column
    with_sources = [r for r in records if r.lm_loss_by_dataset]
    assert len(block.sources) == len(with_sources) == 150
    for record in with_sources:
        losses, tokens = block.sources[record.iteration, record.attempt]
        assert json.dumps(json_safe(losses)) == json.dumps(json_safe(record.lm_loss_by_dataset))
        assert tokens == record.tokens_by_dataset
    replayed = replay_records(block, np.arange(len(block)))
    assert [r.tokens_by_dataset for r in replayed] == [r.tokens_by_dataset for r in records]
