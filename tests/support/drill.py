"""The spike drills' flags and the real-shaped drill, shared by the e2e drill tests and the
lookup's attempt faults (one launch pair per session serves both).

The real-shaped drill: DP=2, 50 iterations; DP rank 1's real documents mis-encoded at 32-36;
the detector flags the onset (32) and every rank exits 42 at 35; ``skiplist --worst 4
--apply`` rolls back to 25 and skips 26-37; the restart (attempt 2) trains 38-50. Both
attempts write one sample log (``samples/``). Before the plan, a copy of what the first
attempt left (its sample log and newest checkpoint, 30) is kept under ``first/``: a run that
has not reached iteration 36 yet.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from megatron_ext.common.files import SAMPLE_LOG_GLOB
from megatron_ext.common.records.sample_log import read_records
from megatron_ext.lookup import cli
from tests.support.harness import Run, launch, run_skiplist

TRAIN_ITERS = 50
BAD = (32, 36)  # garbage tokens on DP rank 1 for these iterations (inclusive)
# The real-shaped drill's grad-norm corroboration: the detector's default. Its onset's grad
# norm is ~1.6x its median (mis-encoded text on one rank of two moves the mean gradient
# little), so only the one-rank excess corroborates the jump, as in a real run's diluted
# bad batch; the other drills' sharper factor (1.5) would call it a grad-norm jump.
REAL_SHAPED_GRAD_FACTOR = 2.0


def drill_args(
    data_args: list[str],
    work: Path,
    bad: str,
    patience: int,
    save_interval: int = 5,
    corruption: str = "garbage",
    grad_factor: float = 1.5,
) -> list[str]:
    ckpt = str(work / "ckpt")
    return [
        *data_args,
        "--train-iters",
        str(TRAIN_ITERS),
        "--save",
        ckpt,
        "--load",
        ckpt,
        "--save-interval",
        str(save_interval),
        "--signals-dir",
        str(work / "signals"),
        "--spike-detect",
        "--spike-window",
        "10",
        "--spike-warmup",
        "20",
        "--spike-grad-factor",
        str(grad_factor),
        "--spike-mad-k",
        "3",
        "--spike-patience",
        str(patience),
        "--drill-corrupt-batch",
        bad,
        "--drill-corruption",
        corruption,
    ]


def real_shaped_drill(work: Path, data_args: list[str]) -> dict:
    """Mis-encoded documents on DP rank 1 at 32-36; plan with the report's top 4; restart."""
    args = drill_args(
        data_args,
        work,
        f"{BAD[0]}-{BAD[1]}:1",
        patience=3,
        corruption="mis-encoded",
        grad_factor=REAL_SHAPED_GRAD_FACTOR,
    )
    first = launch(work, args, nproc=2)
    logs = (work / "samples").glob(SAMPLE_LOG_GLOB)
    trained = {int(p.stem.removeprefix("samples-dp")): list(read_records(p)) for p in logs}
    shutil.copytree(work / "samples", work / "first" / "samples")
    newest = (work / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip()
    shutil.copytree(
        work / "ckpt" / f"iter_{int(newest):07d}",
        work / "first" / "ckpt" / f"iter_{int(newest):07d}",
    )
    (work / "first" / "ckpt" / "latest_checkpointed_iteration.txt").write_text(newest)
    plan = run_skiplist(
        work, "--rollback-iters", "5", "--skip-batches", "12", "--worst", "4", "--apply"
    )
    second = launch(work, args, nproc=2)
    return {"work": work, "first": first, "trained": trained, "plan": plan, "second": second}


def lookup_equals_records(
    run: Run, records: dict, iteration: int, out_dir: Path
) -> list[dict[str, Any]]:
    """``lookup --iteration`` on ``run``'s checkpoint, with its sample log, answers for each
    (DP rank, micro-batch) the sample ids and token digests ``records`` hold; its samples."""
    out = out_dir / "lookup.jsonl"
    argv = ["--from-checkpoint", str(run.workdir / "ckpt"), "--iteration", str(iteration)]
    assert cli.main([*argv, "--sample-log", str(run.samples), "--out", str(out)]) == 0
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    answer: dict[tuple[int, int], list[tuple[int, str]]] = {}
    for sample in samples:
        key = (sample["dp_rank"], sample["microbatch"])
        answer.setdefault(key, []).append((sample["sample_index"], sample["token_sha1"]))
    logged = {
        (r.dp_rank, r.microbatch): list(zip(r.sample_ids, r.token_sha1))
        for rank in records.values()
        for r in rank
        if r.iteration == iteration
    }
    assert answer == logged
    return samples


def check_lookup_equals_sample_log(
    run: Run, work: Path, out_dir: Path, capsys: pytest.CaptureFixture[str], culprit: int = 1
) -> None:
    """At iterations of both attempts of a drill run with the real-shaped drill's window
    (before the rollback target, the onset and the exit, rolled back; after the skipped
    window): ``lookup`` on ``work/ckpt`` answers what the run trained (its sample log in
    ``work/samples``, the records ``run`` kept): the same samples with the same tokens,
    except where the drill corrupted DP rank ``culprit``'s tokens in flight, which the lookup
    names."""
    recorded = {
        (r.iteration, r.dp_rank, r.microbatch): (r.sample_ids, r.token_sha1)
        for records in run.records().values()
        for r in records
    }
    for iteration in (1, 25, BAD[0], 35, 38, TRAIN_ITERS):
        out = out_dir / f"lookup-{iteration}.jsonl"
        argv = ["--from-checkpoint", str(work / "ckpt"), "--iteration", str(iteration)]
        status = cli.main([*argv, "--sample-log", str(work / "samples"), "--out", str(out)])
        assert status == 0, iteration
        answer: dict[tuple[int, int, int], tuple[list[int], list[str]]] = {}
        for line in out.read_text().splitlines():
            sample = json.loads(line)
            ids, digests = answer.setdefault(
                (iteration, sample["dp_rank"], sample["microbatch"]), ([], [])
            )
            ids.append(sample["sample_index"])
            digests.append(sample["token_sha1"])
        trained = {k: v for k, v in recorded.items() if k[0] == iteration}
        assert answer and answer.keys() == trained.keys(), iteration
        corrupted = {k for k in answer if BAD[0] <= iteration <= BAD[1] and k[1] == culprit}
        for key, (ids, digests) in answer.items():
            assert ids == trained[key][0], key
            assert (digests == trained[key][1]) == (key not in corrupted), key
        verdict = capsys.readouterr().out
        assert bool(corrupted) == ("the drill --drill-corrupt-batch" in verdict), verdict
