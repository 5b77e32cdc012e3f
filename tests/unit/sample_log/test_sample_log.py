"""The per-rank sample log survives kill -9 (torn last line) and refuses real corruption."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_ext.common.records.sample_log import SampleLog, SampleRecord, read_records


def _record(iteration: int) -> SampleRecord:
    return SampleRecord(
        iteration=iteration,
        dp_rank=1,
        microbatch=0,
        sample_ids=[4, 5],
        token_sha1=["a", "b"],
        loss_sum=1.5,
        num_tokens=128,
    )


def test_round_trip_and_append_across_restarts(tmp_path: Path) -> None:
    SampleLog(tmp_path, dp_rank=1).write(_record(1))
    SampleLog(tmp_path, dp_rank=1).write(_record(2))  # a restart appends, never truncates
    assert list(read_records(tmp_path / "samples-dp1.jsonl")) == [_record(1), _record(2)]


def test_torn_line_is_skipped_and_the_next_writer_starts_a_new_line(tmp_path: Path) -> None:
    log = SampleLog(tmp_path, dp_rank=1)
    log.write(_record(1))
    with open(log.path, "a") as f:
        f.write('{"iteration":2,"dp_rank":1,"micro')  # what SIGKILL mid-write leaves
    with pytest.warns(UserWarning, match=r"skipped 1 torn line\(s\) at \[2\]"):
        assert list(read_records(log.path)) == [_record(1)]
    SampleLog(tmp_path, dp_rank=1).write(_record(3))  # the restarted run appends
    with pytest.warns(UserWarning, match="torn"):
        assert list(read_records(log.path)) == [_record(1), _record(3)]


def test_json_that_is_not_a_sample_record_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "samples-dp0.jsonl"
    path.write_text('{"iteration": 1}\n')
    with pytest.raises(ValueError, match=r"samples-dp0.jsonl: line 1 is not a sample record"):
        list(read_records(path))
