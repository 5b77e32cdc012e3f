"""GapLog on a real full disk (a 64 KiB tmpfs): failed writes warn once per minute, retry,
and leave one gap record naming the missing iterations when writing works again; readers of
every log it backs (signals, sample log, ledger) skip the gap line and can list it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from megatron_ext.common.gap_log import Gap, GapLog, gap_record, read_gaps
from megatron_ext.common.io import atomic_write
from megatron_ext.common.records.ledger import read_ledger
from megatron_ext.common.records.sample_log import read_records
from megatron_ext.common.records.signals import read_signals
from tests.support.sandbox import run_with_mount

REPO = Path(__file__).resolve().parents[2]

FILL_THEN_FREE = """
import json, os, sys
from megatron_ext.common.gap_log import GapLog
disk = sys.argv[1]
now = [0.0]
log = GapLog(os.path.join(disk, "signals.jsonl"), "signals log", clock=lambda: now[0])
filler = os.path.join(disk, "filler")
with open(filler, "wb", buffering=0) as out:
    try:
        while True:
            out.write(b"x" * 4096)
    except OSError:
        pass
ok = [log.append({"iteration": i, "attempt": 1}, i) for i in range(1, 6)]
now[0] = 61.0
ok.append(log.append({"iteration": 6, "attempt": 1}, 6))  # a second warning, a minute on
os.remove(filler)
ok += [log.append({"iteration": i, "attempt": 1}, i) for i in (7, 8)]
print("OK", json.dumps(ok))
print("FILE", open(os.path.join(disk, "signals.jsonl")).read().replace("\\n", "|"))
"""


def test_a_full_disk_warns_retries_and_records_the_gap(tmp_path) -> None:
    disk = tmp_path / "disk"
    result, _ = run_with_mount(
        [sys.executable, "-c", FILL_THEN_FREE, str(disk)],
        disk,
        size_kib=64,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr
    written = json.loads(result.stdout.split("OK ", 1)[1].splitlines()[0])
    assert written == [False] * 6 + [True, True]
    warnings = [line for line in result.stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 2, result.stderr  # rate-limited: not one per failure
    assert "No space left on device" in warnings[0] and "iterations 1-1" in warnings[0]
    assert "(4 more failures since the last warning)" in warnings[1]
    assert "writable again; iterations 1-6 (6 records) are missing" in result.stderr
    lines = result.stdout.split("FILE ", 1)[1].strip().split("|")
    assert lines[0].startswith('{"gap":{"first_iteration":1,"last_iteration":6,')
    assert lines[1:3] == ['{"iteration":7,"attempt":1}', '{"iteration":8,"attempt":1}']


def test_every_reader_skips_gap_lines_and_lists_them(tmp_path) -> None:
    gap = gap_record(3, 5, 3, "OSError: [Errno 28] No space left on device", 1.0)
    signals = GapLog(tmp_path / "signals.jsonl", "signals log")
    signals.append(
        {
            "iteration": 2,
            "attempt": 1,
            "job_id": "",
            "wall_time": 0.0,
            "consumed_samples": 16,
            "skipped_samples": 0,
            "lm_loss": 1.0,
        },
        2,
    )
    text = (tmp_path / "signals.jsonl").read_text()
    for name in ("signals.jsonl", "samples-dp0.jsonl", "spikes.jsonl"):
        body = text if name == "signals.jsonl" else ""
        atomic_write(tmp_path / name, body + json.dumps(gap) + "\n")
    assert [r.iteration for r in read_signals(tmp_path / "signals.jsonl")] == [2]
    assert list(read_records(tmp_path / "samples-dp0.jsonl")) == []
    assert read_ledger(tmp_path / "spikes.jsonl").events == []
    (found,) = read_gaps(tmp_path / "signals.jsonl")
    assert found == Gap(3, 5, 3, "OSError: [Errno 28] No space left on device", 1.0)
    assert found.covers(4) and not found.covers(6)
