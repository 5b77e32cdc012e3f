"""The spike drills through the real loop (DP=2): bad batch -> the detector flags it and
every rank exits 42 -> plan -> apply -> restart -> the run passes the spike.

Two drills: garbage tokens on DP rank 1 (the grad norm corroborates), and the real-shaped one:
DP rank 1's real documents mis-encoded (``--drill-corruption mis-encoded``), the benchmark's
bad-batch fingerprint. Its DP average rises +17 % and the grad norm x1.2 only (below the
drill's grad factor), so it is one rank's loss over the average that flags it at the onset;
the report must name that rank's documents, by loss, from the sample log.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.common.records.signals import read_signals
from tests.support.drill import BAD, REAL_SHAPED_GRAD_FACTOR, TRAIN_ITERS, drill_args
from tests.support.harness import (
    GLOBAL_BATCH,
    MICRO_BATCH,
    Run,
    checkpoint_args,
    launch,
    run_skiplist,
)


@pytest.fixture(scope="module")
def drill(tmp_path_factory, data_args) -> dict:
    work = tmp_path_factory.mktemp("drill")
    args = drill_args(data_args, work, f"{BAD[0]}-{BAD[1]}:1", patience=3)
    first = launch(work, args, nproc=2)
    plan = run_skiplist(work, "--rollback-iters", "5", "--skip-batches", "12", "--apply")
    shutil.move(str(work / "samples"), str(work / "samples-attempt1"))
    second = launch(work, args, nproc=2)
    return {"work": work, "first": first, "plan": plan, "second": second}


def _ledger(work: Path) -> list[dict]:
    return [
        json.loads(line) for line in (work / "signals" / "spikes.jsonl").read_text().splitlines()
    ]


def test_drill_detects_names_the_rank_and_exits_42(drill: dict) -> None:
    first: Run = drill["first"]
    assert first.returncode != 0
    assert "exiting with code 42 without saving a checkpoint" in first.log
    rollback = next(e for e in _ledger(drill["work"]) if e["kind"] == "rollback")
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
    # The onset batch's documents by loss, from megatron-ext lookup --worst.
    assert "## Top documents of iteration 32 by loss (culprit DP rank 1 first)" in report
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
    from megatron_ext.common.records.sample_log import read_records

    return list(read_records(path))


def test_transient_spike_causes_no_exit_and_no_skip(tmp_path_factory, data_args) -> None:
    work = tmp_path_factory.mktemp("transient")
    run = launch(work, drill_args(data_args, work, "32:1", patience=8, save_interval=2), nproc=2)
    assert run.returncode == 0, run.log[-3000:]
    # While the spike was watched, the checkpoint guard skipped the save of iteration 32.
    assert "spike in progress, not saving iteration 32" in run.log
    assert not (work / "ckpt" / "iter_0000032").exists()
    assert (work / "ckpt" / "iter_0000034").is_dir()
    assert [e["kind"] for e in _ledger(work)] == ["config", "spike", "recovered"]
    assert not (work / "ckpt" / "megatron_ext_skipped_iterations.txt").exists()
    assert checkpoint_args(work / "ckpt", TRAIN_ITERS).skipped_train_samples == 0


# -- the real-shaped drill -------------------------------------------------------------------


# ``real_shaped``: the session fixture of tests/conftest.py (tests/support/drill.py).


def test_real_shaped_spike_is_flagged_at_onset_by_one_rank_over_the_average(real_shaped) -> None:
    assert real_shaped["first"].returncode != 0
    ledger = _ledger(real_shaped["work"])
    config = ledger[0]
    assert (config["kind"], config["attempt"], config["config"]["window"]) == ("config", 1, 10)
    spike, rollback = (e for e in ledger if e["kind"] in ("spike", "rollback"))
    assert (spike["iteration"], spike["onset"], spike["culprit_dp_rank"]) == (BAD[0], BAD[0], 1)
    assert (
        spike["classification"] == "loss jump corroborated by one DP rank's loss over the average"
    )
    # Not the grad norm: under the drill's grad factor, as in the benchmark's diluted bad batch.
    assert spike["grad_norm"] < REAL_SHAPED_GRAD_FACTOR * spike["grad_baseline"]
    assert (rollback["iteration"], rollback["onset"]) == (BAD[0] + 3, BAD[0])


def test_real_shaped_report_names_the_cause_and_the_mis_encoded_documents(real_shaped) -> None:
    plan = real_shaped["plan"]
    assert plan.returncode == 0, plan.stderr
    assert "Roll back to checkpoint 25, skip iterations 26-37" in plan.stdout
    incidents = real_shaped["work"] / "ckpt" / "megatron_ext_incidents"
    report = json.loads((incidents / "incident-001.json").read_text())
    assert report["diagnosis"]["cause"] == "bad-data"
    assert report["diagnosis"]["culprit_dp_rank"] == 1
    # The top 4 by loss are exactly what DP rank 1 trained on at the onset, all mis-encoded.
    injected = {i for r in real_shaped["trained"][1] if r.iteration == BAD[0] for i in r.sample_ids}
    top = report["top_documents"]
    assert {d["sample_index"] for d in top} == injected and len(top) == 4
    assert all(d["dp_rank"] == 1 and d["trained_tokens_differ"] for d in top)
    assert [d["rank_by_loss"] for d in top] == [1, 2, 3, 4]
    markdown = (incidents / "incident-001.md").read_text()
    assert "- likely cause: **single-rank bad data**" in markdown
    assert "Blocklist these documents: `megatron-ext lookup --from-checkpoint" in markdown
    assert top[0]["text"] and f"doc {top[0]['documents'][0]['document']}" in markdown


def test_real_shaped_restart_is_clean_and_the_plot_shows_what_happened(real_shaped) -> None:
    second: Run = real_shaped["second"]
    assert second.returncode == 0, second.log[-3000:]
    work = real_shaped["work"]
    later = [e for e in _ledger(work) if e.get("attempt") == 2]
    assert [e["kind"] for e in later] == ["config"]  # no spike after the skip
    assert checkpoint_args(work / "ckpt", TRAIN_ITERS).skipped_train_samples == 12 * GLOBAL_BATCH
    plot = subprocess.run(
        [sys.executable, "-m", "megatron_ext.cli", "plot", "--signals-dir", str(work / "signals")],
        capture_output=True,
        text=True,
    )
    assert plot.returncode == 0, plot.stderr
    assert "2 tracker event(s)" in plot.stdout and "1 incident plan(s)" in plot.stdout
    assert "incident 1: onset 32, rollback to 25, skip window [26, 37]" in plot.stdout
