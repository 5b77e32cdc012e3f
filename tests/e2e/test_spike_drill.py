"""The spike drill through the real loop (DP=2): bad batch -> the detector flags it and
every rank exits 42 -> plan -> apply -> restart -> the run passes the spike."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.telemetry.signals import read_signals

from harness import GLOBAL_BATCH, MICRO_BATCH, Run, checkpoint_args, launch

TRAIN_ITERS = 50


BAD = (32, 36)  # garbage tokens on DP rank 1 for these iterations (inclusive)


def _drill_args(
    data_args: list[str], work: Path, bad: str, patience: int, save_interval: int = 5
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
        "1.5",
        "--spike-mad-k",
        "3",
        "--spike-patience",
        str(patience),
        "--drill-corrupt-batch",
        bad,
    ]


def _skiplist(work: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_ext.cli",
            "skiplist",
            "--ckpt-dir",
            str(work / "ckpt"),
            "--signals-dir",
            str(work / "signals"),
            *extra,
        ],
        capture_output=True,
        text=True,
    )


@pytest.fixture(scope="module")
def drill(tmp_path_factory, data_args) -> dict:
    work = tmp_path_factory.mktemp("drill")
    args = _drill_args(data_args, work, f"{BAD[0]}-{BAD[1]}:1", patience=3)
    first = launch(work, args, nproc=2)
    shutil.move(str(work / "samples"), str(work / "samples-attempt1"))
    plan = _skiplist(work, "--rollback-iters", "5", "--skip-batches", "12", "--apply")
    second = launch(work, args, nproc=2)
    return {"work": work, "first": first, "plan": plan, "second": second}


def test_drill_detects_names_the_rank_and_exits_42(drill: dict) -> None:
    first: Run = drill["first"]
    assert first.returncode != 0
    assert "exiting with code 42 without saving a checkpoint" in first.log
    ledger = [
        json.loads(line)
        for line in (drill["work"] / "signals" / "spikes.jsonl").read_text().splitlines()
    ]
    rollback = next(e for e in ledger if e["kind"] == "rollback")
    assert rollback["onset"] == BAD[0] and rollback["culprit_dp_rank"] == 1
    assert BAD[0] <= rollback["iteration"] <= BAD[1]
    # It exits before the save of iteration 35: the newest checkpoint predates the spike.
    saved = sorted(
        p.name for p in (drill["work"] / "ckpt" / "rolled_back" / "incident-001").iterdir()
    )
    assert saved == ["iter_0000030"]


def test_drill_plan_rolls_back_before_onset_and_covers_it(drill: dict) -> None:
    plan = drill["plan"]
    assert plan.returncode == 0, plan.stderr
    assert "Roll back to checkpoint 25, skip iterations 26-37" in plan.stdout
    ckpt = drill["work"] / "ckpt"
    report = (ckpt / "megatron_ext_incidents" / "incident-001.md").read_text()
    assert "culprit DP rank (max local loss): 1" in report and "| 32 |" in report
    # The documents DP rank 1 read at the onset, from megatron-ext lookup.
    assert "## What DP rank 1 read at iteration 32" in report
    assert "iteration 32: consumed_train_samples 248 -> 256" in report
    assert json.loads((ckpt / "megatron_ext_incidents" / "incident-001.json").read_text())[
        "skip_window"
    ] == [26, 37]
    assert (ckpt / "rolled_back" / "incident-001" / "iter_0000030").is_dir()


def test_drill_restart_passes_the_spike_with_exactly_the_window_skipped(drill: dict) -> None:
    second: Run = drill["second"]
    assert second.returncode == 0, second.log[-3000:]
    assert "megatron-ext spike tracker" not in second.log
    first_records = {
        int(p.stem.removeprefix("samples-dp")): [r for r in _read(p) if r.iteration <= 25]
        for p in (drill["work"] / "samples-attempt1").glob("samples-dp*.jsonl")
    }
    skipped = range(26, 38)
    for dp_rank, records in second.records().items():
        sequence = first_records[dp_rank] + records
        expected = [
            (k, m)
            for k in range(1, TRAIN_ITERS + 1)
            if k not in skipped
            for m in range(GLOBAL_BATCH // (MICRO_BATCH * 2))
        ]
        assert [(r.iteration, r.microbatch) for r in sequence] == expected
        for r in sequence:
            start = (r.iteration - 1) * GLOBAL_BATCH + (r.microbatch * 2 + dp_rank) * MICRO_BATCH
            assert r.sample_ids == list(range(start, start + MICRO_BATCH))
    final = checkpoint_args(drill["work"] / "ckpt", TRAIN_ITERS)
    assert final.skipped_train_samples == len(skipped) * GLOBAL_BATCH
    assert final.consumed_train_samples == TRAIN_ITERS * GLOBAL_BATCH
    signals = read_signals(drill["work"] / "signals" / "signals.jsonl")
    assert {r.attempt for r in signals if r.iteration > 37} == {2}
    assert all(math.isfinite(r.lm_loss) for r in signals)


def _read(path: Path):
    from megatron_ext.sample_log.core import read_records

    return list(read_records(path))


def test_transient_spike_causes_no_exit_and_no_skip(tmp_path_factory, data_args) -> None:
    work = tmp_path_factory.mktemp("transient")
    run = launch(work, _drill_args(data_args, work, "32:1", patience=8, save_interval=2), nproc=2)
    assert run.returncode == 0, run.log[-3000:]
    # While the spike was watched, the checkpoint guard skipped the save of iteration 32.
    assert "spike in progress, not saving iteration 32" in run.log
    assert not (work / "ckpt" / "iter_0000032").exists()
    assert (work / "ckpt" / "iter_0000034").is_dir()
    kinds = [
        json.loads(line)["kind"]
        for line in (work / "signals" / "spikes.jsonl").read_text().splitlines()
    ]
    assert kinds == ["spike", "recovered"]
    assert not (work / "ckpt" / "megatron_ext_skipped_iterations.txt").exists()
    assert checkpoint_args(work / "ckpt", TRAIN_ITERS).skipped_train_samples == 0
