"""Spike tracker → rollback + skip: detector and planner cores, Megatron's tracker parser, and
the drill through the real loop (DP=2): bad batch → exit 42 → plan → apply → restart → pass."""

from __future__ import annotations

import json
import math
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness import GLOBAL_BATCH, MICRO_BATCH, Run, checkpoint_args, launch
from megatron_ext.signals import SignalRecord, read_signals
from megatron_ext.skip_ranges import expand_argv, format_ranges, parse_item, with_persisted
from megatron_ext.skiplist import PlanConfig, PlanError, make_plan, tracker_lines
from megatron_ext.spikes import SpikeConfig, SpikeDetector

CONFIG = SpikeConfig(window=20, warmup=20, patience=5, grad_factor=3.0)


def _records(n: int, spikes: dict[int, tuple[float, float]] = {}, attempt: int = 1,
             seed: int = 0) -> list[SignalRecord]:
    rng = random.Random(seed)
    out = []
    for i in range(1, n + 1):
        loss, grad = spikes.get(i, (3.0 + rng.gauss(0, 0.02), 1.0 + rng.gauss(0, 0.05)))
        out.append(SignalRecord(iteration=i, attempt=attempt, job_id="j", wall_time=0.0,
                                consumed_samples=8 * i, skipped_samples=0, lm_loss=loss,
                                grad_norm=grad, max_loss_dp_rank=i % 2, max_local_loss=loss))
    return out


def _events(records: list[SignalRecord], config: SpikeConfig = CONFIG) -> list:
    detector = SpikeDetector(config)
    return [e for r in records for e in detector.observe(r)]


# -- detector ------------------------------------------------------------------------------------

def test_transient_spike_is_logged_and_recovers() -> None:
    events = _events(_records(80, {50: (5.0, 6.0), 51: (4.0, 3.5)}))
    assert [(e.kind, e.iteration, e.onset) for e in events] == [
        ("spike", 50, 50), ("recovered", 52, 50)]
    assert events[0].culprit_dp_rank == 0 and events[0].loss_threshold < 5.0
    assert len(events[0].window) == CONFIG.context and events[0].window[-1]["iteration"] == 50


def test_unrecovered_spike_requests_a_rollback_after_patience() -> None:
    stuck = {i: (5.0, 6.0 if i == 50 else 1.0) for i in range(50, 80)}
    events = _events(_records(80, stuck))
    assert [(e.kind, e.iteration, e.onset) for e in events] == [("spike", 50, 50),
                                                                ("rollback", 55, 50)]


def test_non_finite_loss_is_divergence_and_rollback_at_once() -> None:
    events = _events(_records(40, {30: (float("nan"), 1.0)}))
    assert [(e.kind, e.iteration) for e in events] == [("divergence", 30), ("rollback", 30)]


def test_slow_drift_without_grad_corroboration_is_divergence() -> None:
    drift = {i: (4.0, 1.0) for i in range(40, 60)}
    events = _events(_records(60, drift))
    assert [(e.kind, e.iteration, e.onset) for e in events] == [
        ("divergence", 44, 40), ("rollback", 44, 40)]


def test_not_armed_during_warmup_and_noise_is_not_a_spike() -> None:
    assert _events(_records(15, {10: (9.0, 9.0)})) == []
    assert _events(_records(2000, seed=3)) == []


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError, match="grad_factor > 1"):
        SpikeConfig(grad_factor=1.0)
    with pytest.raises(ValueError, match="warmup >= window/2"):
        SpikeConfig(window=100, warmup=10)


# -- planner -------------------------------------------------------------------------------------

def _ledger(records: list[SignalRecord]) -> list[dict]:
    return [e.as_json() for e in _events(records)]


STUCK = {i: (5.0, 6.0 if i == 150 else 1.0) for i in range(150, 200)}


def test_plan_rolls_back_k_before_onset_and_skips_a_window_reaching_past_it() -> None:
    records = _records(200, STUCK)
    plan = make_plan(_ledger(records), records, [50, 100, 140, 150], [20, 21],
                     PlanConfig(rollback_iters=40, skip_batches=60), 1000, "/ckpt")
    assert plan.rollback_to == 100 and plan.moved_checkpoints == [140, 150]
    assert plan.skip_window == [101, 160] and plan.skip_ranges == [[20, 21], [101, 160]]
    assert plan.restart_args == ["--load", "/ckpt", "--iterations-to-skip", "20-21", "101-160"]
    assert "Roll back to checkpoint 100, skip iterations 101-160" in plan.summary


def test_onset_moves_earlier_when_the_grad_norm_rose_first() -> None:
    records = _records(200, {**STUCK, 147: (3.0, 2.5), 148: (3.0, 2.6), 149: (3.0, 2.4)})
    ledger = _ledger(records)
    plan = make_plan(ledger, records, [100, 110], [], PlanConfig(rollback_iters=38,
                     skip_batches=60), None, "/c")
    assert plan.onset == 147 and plan.rollback_to == 100  # 147 - 38 = 109 < 110


def test_beta2_window_and_impossible_plans() -> None:
    records = _records(200, STUCK)
    ledger = _ledger(records)
    plan = make_plan(ledger, records, [100], [], PlanConfig(rollback_iters=10, beta2=0.95),
                     None, "/c")
    assert plan.skip_window == [101, 300]  # 10 time constants of beta2=0.95
    with pytest.raises(PlanError, match=r"no complete checkpoint at or before iteration 140"):
        make_plan(ledger, records, [145, 150], [], PlanConfig(rollback_iters=10), None, "/c")
    with pytest.raises(PlanError, match="runs past --train-iters 250"):
        make_plan(ledger, records, [100], [], PlanConfig(rollback_iters=10, skip_batches=300),
                  250, "/c")
    with pytest.raises(PlanError, match="does not reach the incident at iteration 155"):
        make_plan(ledger, records, [100], [], PlanConfig(rollback_iters=10, skip_batches=20),
                  None, "/c")
    with pytest.raises(PlanError, match="no rollback request"):
        make_plan(_ledger(_records(80, {50: (5.0, 6.0)})), records, [10], [], PlanConfig(),
                  None, "/c")


def test_confirm_policy_replays_first_then_skips_and_megatron_agrees(tmp_path: Path) -> None:
    first = _ledger(_records(200, STUCK, attempt=1))
    replay = make_plan(first, [], [100], [], PlanConfig(rollback_iters=10, policy="confirm"),
                       None, "/c")
    assert replay.action == "rollback-and-replay" and replay.skip_window is None
    assert replay.tracker_lines == []
    both = first + _ledger(_records(200, STUCK, attempt=2))
    confirmed = make_plan(both, [], [100], [], PlanConfig(rollback_iters=10, policy="confirm",
                                                          skip_batches=60), None, "/c")
    assert confirmed.action == "rollback-and-skip" and len(confirmed.tracker_lines) == 2
    tracker = tmp_path / "tracker.txt"
    other_tool = ("ts=2026-01-01 node=n1 device=0 jobID=7 rank=3 iteration=99 "
                  "status=RerunValidationStatus.RERUN_DISABLED result=nan message='x'\n")
    tracker.write_text(other_tool + "garbage line from another tool\n"
                       + "".join(confirmed.tracker_lines))
    from megatron.core.rerun_state_machine import RerunStateMachine

    assert RerunStateMachine.get_skipped_iterations_from_tracker_file(str(tracker)) == [150]
    assert tracker_lines(confirmed.incident, both)[0].startswith("ts=megatron-ext ")


# -- skip ranges ---------------------------------------------------------------------------------

def test_ranges_files_and_persisted_lists(tmp_path: Path) -> None:
    assert parse_item("137000-137003") == [137000, 137001, 137002, 137003]
    with pytest.raises(ValueError, match="bad range '9-3'"):
        parse_item("9-3")
    skip_file = tmp_path / "skip.txt"
    skip_file.write_text("# incident 1\n10-12\n\n20\n")
    argv, requested = expand_argv(["--lr", "1", "--iterations-to-skip", "5", "7-8",
                                   "--iterations-to-skip-file", str(skip_file), "--seed", "3"])
    assert argv == ["--lr", "1", "--seed", "3"] and requested == [5, 7, 8, 10, 11, 12, 20]
    (tmp_path / "megatron_ext_skipped_iterations.txt").write_text("30-31\n")
    assert with_persisted(argv, [5], str(tmp_path))[-4:] == ["--iterations-to-skip", "5", "30",
                                                             "31"]
    assert format_ranges([3, 1, 2, 7]) == "1-3\n7\n"
    bad = tmp_path / "bad.txt"
    bad.write_text("12\nx-3\n")
    with pytest.raises(ValueError, match=r"bad.txt:2: bad iteration or range 'x-3'"):
        expand_argv(["--iterations-to-skip-file", str(bad)])


# -- the drill in the real loop --------------------------------------------------------------------

TRAIN_ITERS = 50
BAD = (32, 36)  # garbage tokens on DP rank 1 for these iterations (inclusive)


def _drill_args(data_args: list[str], work: Path, bad: str, patience: int,
                save_interval: int = 5) -> list[str]:
    ckpt = str(work / "ckpt")
    return [*data_args, "--train-iters", str(TRAIN_ITERS), "--save", ckpt, "--load", ckpt,
            "--save-interval", str(save_interval), "--signals-dir", str(work / "signals"), "--spike-detect",
            "--spike-window", "10", "--spike-warmup", "20", "--spike-grad-factor", "1.5",
            "--spike-mad-k", "3",
            "--spike-patience", str(patience), "--drill-corrupt-batch", bad]


def _skiplist(work: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "megatron_ext.cli", "skiplist",
                           "--ckpt-dir", str(work / "ckpt"), "--signals-dir",
                           str(work / "signals"), *extra], capture_output=True, text=True)


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
    ledger = [json.loads(line) for line in
              (drill["work"] / "signals" / "spikes.jsonl").read_text().splitlines()]
    rollback = [e for e in ledger if e["kind"] == "rollback"][0]
    assert rollback["onset"] == BAD[0] and rollback["culprit_dp_rank"] == 1
    assert BAD[0] <= rollback["iteration"] <= BAD[1]
    # It exits before the save of iteration 35: the newest checkpoint predates the spike.
    saved = sorted(p.name for p in (drill["work"] / "ckpt" / "rolled_back" / "incident-001").iterdir())
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
        "skip_window"] == [26, 37]
    assert (ckpt / "rolled_back" / "incident-001" / "iter_0000030").is_dir()


def test_drill_restart_passes_the_spike_with_exactly_the_window_skipped(drill: dict) -> None:
    second: Run = drill["second"]
    assert second.returncode == 0, second.log[-3000:]
    assert "megatron-ext spike tracker" not in second.log
    first_records = {
        int(p.stem.removeprefix("samples-dp")): [r for r in _read(p) if r.iteration <= 25]
        for p in (drill["work"] / "samples-attempt1").glob("samples-dp*.jsonl")}
    skipped = range(26, 38)
    for dp_rank, records in second.records().items():
        sequence = first_records[dp_rank] + records
        expected = [(k, m) for k in range(1, TRAIN_ITERS + 1) if k not in skipped
                    for m in range(GLOBAL_BATCH // (MICRO_BATCH * 2))]
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
    from megatron_ext.sample_log import read_records

    return list(read_records(path))


def test_transient_spike_causes_no_exit_and_no_skip(tmp_path_factory, data_args) -> None:
    work = tmp_path_factory.mktemp("transient")
    run = launch(work, _drill_args(data_args, work, "32:1", patience=8, save_interval=2),
                 nproc=2)
    assert run.returncode == 0, run.log[-3000:]
    # While the spike was watched, the checkpoint guard skipped the save of iteration 32.
    assert "spike in progress, not saving iteration 32" in run.log
    assert not (work / "ckpt" / "iter_0000032").exists()
    assert (work / "ckpt" / "iter_0000034").is_dir()
    kinds = [json.loads(line)["kind"] for line in
             (work / "signals" / "spikes.jsonl").read_text().splitlines()]
    assert kinds == ["spike", "recovered"]
    assert not (work / "ckpt" / "megatron_ext_skipped_iterations.txt").exists()
    assert checkpoint_args(work / "ckpt", TRAIN_ITERS).skipped_train_samples == 0


def test_entry_point_merges_the_list_persisted_with_the_loaded_checkpoints(tmp_path: Path) -> None:
    import pretrain_gpt_ext

    (tmp_path / "megatron_ext_skipped_iterations.txt").write_text("5-6\n")
    for load in (["--load", str(tmp_path)], [f"--load={tmp_path}"]):
        argv = pretrain_gpt_ext._expand_skips([*load, "--iterations-to-skip", "9-10"])
        assert argv == [*load, "--iterations-to-skip", "5", "6", "9", "10"]
    with pytest.raises(SystemExit, match="bad range"):
        pretrain_gpt_ext._expand_skips(["--iterations-to-skip", "10-9"])


def test_planner_merges_applied_skips_but_not_an_unapplied_earlier_plan(tmp_path: Path) -> None:
    from megatron_ext.jsonl import JsonlAppender

    signals, ckpt = tmp_path / "signals", tmp_path / "ckpt"
    records = _records(200, STUCK)
    writer, ledger = JsonlAppender(signals / "signals.jsonl"), JsonlAppender(signals / "spikes.jsonl")
    for record in records:
        writer.append(record.as_json())
    for event in _events(records):
        ledger.append(event.as_json())
    for iteration in (100, 140):
        (ckpt / f"iter_{iteration:07d}").mkdir(parents=True)
        (ckpt / f"iter_{iteration:07d}" / "metadata.json").write_text("{}")
    (ckpt / "megatron_ext_skipped_iterations.txt").write_text("20-21\n")  # applied earlier
    common = ["--no-lookup", "--train-iters", "1000", "--skip-batches", "60"]
    first = _skiplist(tmp_path, *common, "--rollback-iters", "40")  # planned, not applied
    assert first.returncode == 0 and "skip iterations 101-160" in first.stdout, first.stderr
    second = _skiplist(tmp_path, *common, "--rollback-iters", "10")
    assert second.returncode == 0, second.stderr
    assert "all skipped iterations: 20-21, 141-200." in second.stdout
    plan = json.loads((ckpt / "megatron_ext_incidents" / "incident-002.json").read_text())
    assert plan["skip_ranges"] == [[20, 21], [141, 200]]
