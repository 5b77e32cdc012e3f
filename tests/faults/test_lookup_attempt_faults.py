"""The lookup after a real spike drill: the onset and the iterations trained and then rolled
back and skipped are answered with what was trained there, per attempt; two writers in one
sample log and an iteration the run has not reached are refused.

All on the real-shaped drill (tests/support/drill.py, shared with tests/e2e/test_spike_drill.py):
attempt 1 trained 1-35 (DP rank 1's documents mis-encoded in flight at 32-36, onset 32), the
plan rolled back to 25 and skipped 26-37, attempt 2 trained 38-50; one sample log holds both.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_ext.common.files import sample_log_file
from megatron_ext.common.records.sample_log import SampleLog, read_records
from megatron_ext.lookup import cli
from tests.support.drill import BAD
from tests.support.faults import fault

pytestmark = pytest.mark.e2e

ONSET = BAD[0]
ROLLED_BACK = "trained it; rolled back (attempt 2 resumed from iteration 25), skipped afterwards"


def _lookup(capsys, directory: Path, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["--from-checkpoint", str(directory / "ckpt"), *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _json(capsys, work: Path, *argv: str) -> dict:
    code, out, err = _lookup(capsys, work, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def _slots(answer: dict) -> dict[tuple[int, int], list[int]]:
    slots: dict[tuple[int, int], list[int]] = {}
    for sample in answer["samples"]:
        slots.setdefault((sample["dp_rank"], sample["microbatch"]), []).append(
            sample["sample_index"]
        )
    return slots


def _trained(records: dict, iteration: int) -> dict[tuple[int, int], list[int]]:
    return {
        (r.dp_rank, r.microbatch): r.sample_ids
        for rank in records.values()
        for r in rank
        if r.iteration == iteration
    }


@fault(
    "after a real drill (onset 32 trained by attempt 1, rolled back to 25, 26-37 skipped by "
    "attempt 2), `lookup --iteration 32 --dp-rank 1 [--sample-log] [--worst]`, and 30",
    "answered with attempt 1's batch (the onset's, equal to its sample log), naming both "
    "attempts and what became of it; attempt 1's records compared (rank 1's in-flight "
    "corruption answered: same samples, trained tokens differ from disk, both SHA-1s and the "
    "drill named); --worst labelled attempt 1, no SKIPPED header",
    area="lookup",
)
def test_lookup_answers_the_onset_and_the_rolled_back_iterations_per_attempt(
    real_shaped, capsys
) -> None:
    work, trained = real_shaped["work"], real_shaped["trained"]
    assert real_shaped["second"].returncode == 0, real_shaped["second"].log[-3000:]
    samples = str(work / "samples")
    for iteration in (ONSET, 30):
        check = ("--sample-log", samples) if iteration == 30 else ()
        answer = _json(capsys, work, "--iteration", str(iteration), *check)
        assert answer["attempt"] == 1 and not answer["batch"]["skipped"]
        assert [(a["attempt"], a["trained"]) for a in answer["attempts"]] == [(1, True), (2, False)]
        assert answer["attempts"][0]["fate"] == f"{ROLLED_BACK} by attempt 2"
        assert answer["attempts"][1]["fate"] == "skipped it (--iterations-to-skip)"
        assert _slots(answer) == _trained(trained, iteration) != {}
        if iteration == 30:  # clean data: every attempt-1 record of it compared
            verdict = "sample log: 4 micro-batches match the training record (attempt 1: 4)"
            assert verdict in answer["lines"]
    code, out, err = _lookup(capsys, work, "--iteration", str(ONSET), "--dp-rank", "1")
    assert code == 0, err
    assert "SKIPPED" not in out and f"answer: what attempt 1 read at iteration {ONSET}" in out
    assert "attempt 1 (from iteration 1" in out and ROLLED_BACK in out
    # Rank 1's tokens were mis-encoded in flight: the samples are the ones trained, their
    # tokens not the disk's. Said, with both SHA-1s and the drill the layout log records.
    code, out, err = _lookup(
        capsys, work, "--iteration", str(ONSET), "--dp-rank", "1", "--sample-log", samples
    )
    assert code == 0 and "the data changed since training" not in out + err, (out, err)
    assert "2 trained on the same samples with other tokens" in out, out
    assert out.count("the same samples, but the tokens trained differ from the data on disk") == 2
    assert "token SHA-1s trained ['" in out and "], on disk ['" in out
    assert f"the drill --drill-corrupt-batch {BAD[0]}-{BAD[1]}:1 corrupted it in flight" in out
    code, out, err = _lookup(
        capsys, work, "--iteration", str(ONSET), "--dp-rank", "0", "--sample-log", samples
    )
    assert code == 0 and "2 micro-batches match the training record (attempt 1: 2)" in out, err
    worst = _json(capsys, work, "--iteration", str(ONSET), "--dp-rank", "1", "--worst", "4")
    assert not any("SKIPPED" in line for line in worst["lines"])
    assert worst["lines"][-1].startswith("note: 4 of them were trained on tokens that differ")
    assert any(f"attempt 1: {ROLLED_BACK}" in line for line in worst["lines"])
    injected = {i for ids in _trained({1: trained[1]}, ONSET).values() for i in ids}
    assert {s["sample_index"] for s in worst["samples"]} == injected
    assert {(s["attempt"], s["dp_rank"]) for s in worst["samples"]} == {(1, 1)}
    code, out, err = _lookup(
        capsys, work, "--iteration", str(ONSET), "--dp-rank", "1", "--worst", "2"
    )
    assert code == 0 and "SKIPPED" not in out, err
    assert out.count("  attempt 1  [trained tokens differ]") == 2, out


@fault(
    "after the drill, `lookup` of 36 (skipped; attempt 1 stopped at 35) and 40 (trained by "
    "attempt 2 only), with --sample-log; 33 with no sample log at hand",
    "36: SKIPPED by every attempt, attempt 1 left out (its log ends before); 40: attempt 2's "
    "batch, equal to its sample log; 33: attempt 1 named as one that may have trained it",
    area="lookup",
)
def test_lookup_names_attempts_that_did_not_reach_or_skipped_an_iteration(
    real_shaped, tmp_path, capsys
) -> None:
    work = real_shaped["work"]
    samples = str(work / "samples")
    skipped = _json(capsys, work, "--iteration", "36", "--dp-rank", "0", "--sample-log", samples)
    assert skipped["batch"]["skipped"] and skipped["attempt"] == 2
    # Attempt 1 stopped at 35: its sample log says it never got to 36, so it is no answer.
    assert [(a["attempt"], a["trained"]) for a in skipped["attempts"]] == [(2, False)]
    assert any("not trained on by any attempt" in line for line in skipped["lines"])
    # Without a sample log (nor its layout log: attempts from the checkpoints) nothing says
    # how far attempt 1 got before the rollback.
    (work / "samples").rename(tmp_path / "samples")
    try:
        hidden = _json(capsys, work, "--iteration", "33")
    finally:
        (tmp_path / "samples").rename(work / "samples")
    assert hidden["batch"]["skipped"] and hidden["attempt"] == 2
    assert hidden["attempts"][0]["fate"].startswith("may have trained it before attempt 2")
    later = _json(capsys, work, "--iteration", "40", "--sample-log", samples)
    assert later["attempt"] == 2 and not later["batch"]["skipped"]
    assert "sample log: 4 micro-batches match the training record (attempt 2: 4)" in later["lines"]
    assert [a["attempt"] for a in later["attempts"]] == [2]
    assert later["attempts"][0]["fate"] == "trained it; kept (checkpoint 50 holds it)"


@fault(
    "`lookup` of an iteration past the run's progress (the drill's first attempt: records to "
    "35, newest checkpoint 30): 40, then 33",
    "40: refused as not yet trained (exit 3), naming where the records end; 33 (trained, "
    "not checkpointed) answered, saying no checkpoint holds it yet",
    area="lookup",
)
def test_lookup_refuses_an_iteration_the_run_has_not_reached(real_shaped, capsys) -> None:
    first = real_shaped["work"] / "first"
    samples = str(first / "samples")
    code, out, err = _lookup(capsys, first, "--iteration", "40", "--sample-log", samples)
    assert code == 3 and out == "", (out, err)
    assert re.search(
        r"iteration 40 is not yet trained: .* ends at iteration 3[45], its newest "
        r"checkpoint is 30",
        err,
    ), err
    # DP rank 0: rank 1's tokens at 32-36 were mis-encoded in flight (the drill).
    answer = _json(capsys, first, "--iteration", "33", "--dp-rank", "0", "--sample-log", samples)
    assert answer["attempts"] == [
        {
            "attempt": 1,
            "first_iteration": 1,
            "trained": True,
            "fate": "trained it; no checkpoint holds it yet (newest: 30)",
            "job_id": answer["attempts"][0]["job_id"],
        }
    ]
    assert _slots(answer) == _trained({0: real_shaped["trained"][0]}, 33) != {}
    assert "sample log: 2 micro-batches match the training record (attempt 1: 2)" in answer["lines"]


@fault(
    "two trainings appending to one sample log at once (two real writers on DP rank 1's file, "
    "interleaved, one with other samples), then `lookup --iteration 47 --sample-log`",
    "refused (exit 1): two different records of one micro-batch in one attempt, two writers "
    "named; DP rank 0's untouched file still matches",
    area="lookup",
)
def test_two_writers_in_one_sample_log_are_refused(real_shaped, tmp_path, capsys) -> None:
    work = real_shaped["work"]
    samples = shutil.copytree(work / "samples", tmp_path / "samples")
    real = [r for r in read_records(sample_log_file(samples, 1)) if r.iteration >= 46]
    first, second = SampleLog(samples, 1, "job-A"), SampleLog(samples, 1, "job-B")
    for record in real:  # both resumed from 45: A trains what the run did, B another seed's
        first.write(record)
        second.write(replace(record, sample_ids=[i + 1000 for i in record.sample_ids]))
    base = ["--iteration", "47", "--sample-log", str(samples)]
    code, out, err = _lookup(capsys, work, *base, "--dp-rank", "1")
    assert code == 1, (out, err)
    assert "iteration 47 DP rank 1 micro-batch 0" in err and "two different records" in err
    assert "two trainings wrote to one run directory" in err
    code, out, err = _lookup(capsys, work, *base, "--dp-rank", "0")
    assert code == 0 and "2 micro-batches match the training record (attempt 2: 2)" in out, err
