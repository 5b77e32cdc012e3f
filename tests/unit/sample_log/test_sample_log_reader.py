"""Reading one iteration of the sample log without reading the rest of it.

Logs are written by the real writer (``SampleLog``), restarts by a new writer on the same file
(as a requeued attempt does), torn lines as a kill -9 leaves them (a record cut short, then the
next writer's newline). The byte counts come from the reader's counters and from the kernel's
own count of what this process read (``/proc/self/io``), so a reader that went back to parsing
whole files fails here.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_ext.common.files import sample_log_attempts_file, sample_log_file
from megatron_ext.common.records.sample_log import SampleLog, SampleRecord, read_records
from megatron_ext.common.records.sample_log_reader import RankLog, latest
from megatron_ext.lookup.crosscheck import check_against_log, ranked_samples
from megatron_ext.lookup.errors import DataChanged, TwoWriters
from megatron_ext.lookup.history import Segment
from tests.support.io_counters import PROC_IO, rchar

MICROBATCHES = 4


def _record(iteration: int, rank: int, microbatch: int, attempt: int) -> SampleRecord:
    ids = [10_000 * attempt + 8 * iteration + 2 * microbatch + k for k in range(2)]
    return SampleRecord(
        iteration=iteration,
        dp_rank=rank,
        microbatch=microbatch,
        sample_ids=ids,
        token_sha1=[f"{i:040x}" for i in ids],
        loss_sum=1.5 * iteration,
        num_tokens=256,
        sample_losses=[3.0 + microbatch + k / 10 for k in range(2)],
        lm_loss_sum=1.5 * iteration,
    )


def _attempt(directory: Path, rank: int, iterations: range, attempt: int) -> None:
    log = SampleLog(directory, rank, job_id=f"job{attempt}")
    for iteration in iterations:
        for microbatch in range(MICROBATCHES):
            log.write(_record(iteration, rank, microbatch, attempt))


def _torn(directory: Path, rank: int, iteration: int) -> None:
    """What kill -9 in the middle of a record's write leaves: the record cut short."""
    with open(sample_log_file(directory, rank), "ab") as out:
        out.write(f'{{"iteration":{iteration},"dp_rank":{rank},"microbatch":3,"sample_'.encode())


def _restarted_log(directory: Path, rank: int = 0, length: int = 100) -> Path:
    """Attempt 1 trains 1..50 and is killed writing iteration 50's last micro-batch;
    attempt 2 resumes from the checkpoint at 40 and trains 41..``length``."""
    log = SampleLog(directory, rank, job_id="job1")
    for iteration in range(1, 51):
        for microbatch in range(MICROBATCHES if iteration < 50 else 3):
            log.write(_record(iteration, rank, microbatch, 1))
    _torn(directory, rank, 50)
    _attempt(directory, rank, range(41, length + 1), 2)
    return sample_log_file(directory, rank)


def _by_attempt(path: Path, iteration: int) -> list[tuple[bool, list[int]]]:
    """Per group: read through the index?, and which attempt wrote each record."""
    with RankLog(path) as log, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        groups = log.iteration(iteration)
    assert len({g.attempt.start for g in groups}) == len(groups)  # one group per attempt
    return [(g.attempt.indexed, [r.sample_ids[0] // 10_000 for r in g.records]) for g in groups]


def test_a_restart_appends_an_iteration_again_and_the_later_attempt_wins(tmp_path: Path) -> None:
    path = _restarted_log(tmp_path)
    every = list(read_records(path))  # the whole-file reader, as the reference
    with RankLog(path) as log:
        assert [a.info["first_iteration"] for a in log.attempts] == [1, 41]
        for iteration in (1, 30, 40, 41, 45, 49, 51, 75, 100):
            expected = [r for r in every if r.iteration == iteration]
            groups = log.iteration(iteration)
            assert [r for g in groups for r in g.records] == expected, iteration
            assert list(latest(groups).values()) == expected[-MICROBATCHES:], iteration
            assert {g.attempt.info["job_id"] for g in groups} == (
                {"job1", "job2"}
                if 41 <= iteration <= 50
                else {"job1" if iteration < 41 else "job2"}
            )
        assert log.iteration(101) == [] and log.iteration(0) == []
        assert log.records_parsed == sum(
            1 for r in every if r.iteration in (1, 30, 40, 41, 45, 49, 51, 75, 100)
        )


def test_a_torn_line_is_skipped_and_reported(tmp_path: Path) -> None:
    path = _restarted_log(tmp_path)
    with RankLog(path) as log, pytest.warns(UserWarning, match="1 torn line"):
        groups = log.iteration(50)
    assert [(g.attempt.ordinal, [r.microbatch for r in g.records]) for g in groups] == [
        (1, [0, 1, 2]),
        (2, [0, 1, 2, 3]),
    ]
    assert {r.sample_ids[0] // 10_000 for r in latest(groups).values()} == {2}


def test_one_iteration_reads_a_few_blocks_and_stays_flat_in_log_length(tmp_path: Path) -> None:
    short = _restarted_log(tmp_path / "short", length=200)
    long = _restarted_log(tmp_path / "long", length=4000)
    reads = []
    for path in (short, long):
        with RankLog(path) as log:
            assert len(latest(log.iteration(150))) == MICROBATCHES
            reads.append(log.bytes_read)
            assert log.records_parsed == MICROBATCHES
    size = long.stat().st_size
    assert size > 15 * short.stat().st_size
    assert reads[1] < 0.02 * size, (reads, size)
    assert reads[1] < 2 * reads[0], reads  # 19x the log, a few more bisection steps


def test_without_a_usable_attempt_index_the_file_is_scanned_with_the_same_answer(
    tmp_path: Path,
) -> None:
    path = _restarted_log(tmp_path)
    index = sample_log_attempts_file(tmp_path, 0)
    expected = [(False, [1] * MICROBATCHES), (False, [2] * MICROBATCHES)]
    assert _by_attempt(path, 45) == [(True, a) for _, a in expected]
    lines = index.read_text().splitlines()
    index.write_text(lines[0] + "\n" + lines[1].replace('"offset":', '"offset":1') + "\n")
    with RankLog(path) as log:
        assert [a.indexed for a in log.attempts] == [False]  # not at a line start: ignored
    assert _by_attempt(path, 45) == expected
    index.unlink()  # a log written before the index existed
    assert _by_attempt(path, 45) == expected
    with RankLog(path) as log:
        log.iteration(45)
        assert log.bytes_read == path.stat().st_size  # honest: it had to read everything


def test_a_run_that_is_not_sorted_is_read_line_by_line(tmp_path: Path) -> None:
    """Two writers under one attempt line (a second training on the same directory)."""
    _attempt(tmp_path, 0, range(1, 21), 1)
    with open(sample_log_file(tmp_path, 0), "a") as out:  # a writer that kept no index
        for microbatch in range(MICROBATCHES):
            record = _record(5, 0, microbatch, 7)
            out.write(
                f'{{"iteration":5,"dp_rank":0,"microbatch":{microbatch},"sample_ids":'
                f'{record.sample_ids},"token_sha1":["a","b"],"loss_sum":0.0,"num_tokens":0}}\n'
            )
    with RankLog(sample_log_file(tmp_path, 0)) as log, pytest.warns(UserWarning, match="order"):
        groups = log.iteration(5)
    assert [len(g.records) for g in groups] == [MICROBATCHES, MICROBATCHES]
    assert latest(groups)[0].sample_ids[0] // 10_000 == 7


@pytest.mark.skipif(not PROC_IO.is_file(), reason="needs Linux /proc/self/io")
def test_the_check_and_worst_read_only_the_asked_iteration(tmp_path: Path) -> None:
    ranks = 4
    for rank in range(ranks):
        _restarted_log(tmp_path, rank, length=1500)
    total = sum(sample_log_file(tmp_path, r).stat().st_size for r in range(ranks))
    one_file = sample_log_file(tmp_path, 2).stat().st_size
    answered = [
        {
            "iteration": 45,
            "dp_rank": r.dp_rank,
            "microbatch": r.microbatch,
            "sample_index": sample,
            "token_sha1": digest,
            "skipped": False,
        }
        for rank in range(ranks)
        for r in latest(RankLog(sample_log_file(tmp_path, rank)).iteration(45)).values()
        for sample, digest in zip(r.sample_ids, r.token_sha1)
    ]
    check_against_log(tmp_path, answered)  # once first: lazy imports read .py files too
    before = rchar()
    verdict = check_against_log(tmp_path, answered)
    check_bytes = rchar() - before
    assert verdict.startswith(f"sample log: {ranks * MICROBATCHES} micro-batches match")
    bound = 64 << 10  # per rank file: a bisection per attempt, whatever the file's length
    assert total > 20 * ranks * bound
    assert check_bytes < ranks * bound, (check_bytes, total)

    before = rchar()
    ranked = ranked_samples(tmp_path, 1200, dp_rank=2)
    one_rank_bytes = rchar() - before
    assert {r.dp_rank for r in ranked} == {2} and len(ranked) == 2 * MICROBATCHES
    assert one_rank_bytes < bound < one_file / 20, (one_rank_bytes, one_file)

    before = rchar()
    ranked = ranked_samples(tmp_path, 1200)
    assert len(ranked) == ranks * 2 * MICROBATCHES
    assert rchar() - before < ranks * bound


def test_two_writers_interleaved_in_one_file_are_found_and_refused(tmp_path: Path) -> None:
    """Two trainings resumed from iteration 40 on one run directory: A (this data) runs three
    iterations ahead of B (another seed's samples), their lines interleaved as the two
    processes append. The asked iteration's records of both are found, wherever the
    bisection lands (the scan reads one line past the iteration: a reader that stopped at the
    first line past it missed them at a third of these iterations), and the check refuses them."""
    _attempt(tmp_path, 0, range(1, 41), 1)
    first, second = SampleLog(tmp_path, 0, "jobA"), SampleLog(tmp_path, 0, "jobB")
    for iteration in range(41, 101):
        for microbatch in range(MICROBATCHES):
            first.write(_record(iteration, 0, microbatch, 1))
            if iteration > 43:
                second.write(_record(iteration - 3, 0, microbatch, 7))
    path = sample_log_file(tmp_path, 0)
    for iteration in range(41, 98):  # B trained 41..97
        with RankLog(path) as log, pytest.warns(UserWarning, match="two writers"):
            groups = log.iteration(iteration)
        writers = {r.sample_ids[0] // 10_000 for g in groups for r in g.records}
        assert writers == {1, 7}, iteration
    for iteration in (45, 60, 90):
        answered = [
            {
                "iteration": iteration,
                "dp_rank": 0,
                "microbatch": m,
                "sample_index": s,
                "token_sha1": f"{s:040x}",
                "skipped": False,
            }
            for m in range(MICROBATCHES)
            for s in _record(iteration, 0, m, 1).sample_ids
        ]
        with warnings.catch_warnings(), pytest.raises(TwoWriters, match="two different records"):
            warnings.simplefilter("ignore")
            check_against_log(tmp_path, answered, {2: answered}, answered=2)


def _answer(record: SampleRecord, digests: list[str] | None = None) -> list[dict]:
    return [
        {
            "iteration": record.iteration,
            "dp_rank": record.dp_rank,
            "microbatch": record.microbatch,
            "sample_index": sample,
            "token_sha1": digest,
            "skipped": False,
        }
        for sample, digest in zip(record.sample_ids, digests or record.token_sha1)
    ]


def test_tokens_corrupted_in_flight_are_said_with_both_digests_and_the_drill(
    tmp_path: Path,
) -> None:
    """After `demo --drill`, `lookup --sample-log` of the onset batch refused with "the data
    changed since training": the drill corrupted the batch in flight. The same samples with
    other tokens are answered when the layout log records a drill that hit that batch, both
    SHA-1s shown and the drill named; without one (or a drill of another rank) it is changed
    data, refused with both SHA-1s; other samples are refused as before."""
    _attempt(tmp_path, 1, range(1, 6), 1)
    trained = _record(4, 1, 2, 1)
    disk = [f"{i + 7:040x}" for i in trained.sample_ids]  # what the data gives today
    answered = _answer(trained, disk)
    plain = Segment(1, 0, {}, frozenset(), {}, "layout log line 1")
    verdict = check_against_log(
        tmp_path, answered, segments=(replace(plain, drill="3-4:1"),), answered=1
    )
    first, note = verdict.splitlines()
    assert first == (
        "sample log: 0 micro-batches match the training record, 1 trained on the same "
        "samples with other tokens (below)"
    )
    assert note.startswith("  iteration 4 DP rank 1 micro-batch 2 (attempt 1): the same samples")
    assert f"trained {trained.token_sha1}, on disk {disk}" in note
    assert note.endswith("the drill --drill-corrupt-batch 3-4:1 corrupted it in flight")
    for segments in ((plain,), (replace(plain, drill="3-4:0"),)):  # none, or rank 0's
        with pytest.raises(DataChanged, match="no drill is recorded for this batch") as refused:
            check_against_log(tmp_path, answered, segments=segments, answered=1)
        assert f"trained {trained.token_sha1}, on disk {disk}" in str(refused.value)
    other = [dict(r, sample_index=r["sample_index"] + 1) for r in answered]
    with pytest.raises(DataChanged, match="the data changed since training"):
        check_against_log(tmp_path, other, segments=(plain,), answered=1)
