"""`megatron-ext skiplist` reads only what a plan needs, and plans what a full scan plans.

The runs are drill-shaped: the detector's own ledger over synthetic signals with a spike that
does not recover, a rollback, the same spike again in the replay (a restart: the log repeats
lower iterations under attempt 2), checkpoints with an incomplete one among them.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from megatron_ext.common.io import JsonlAppender, json_safe, read_jsonl
from megatron_ext.common.records.signals import SignalsWriter, read_signals
from megatron_ext.incidents import cli, planner
from megatron_ext.incidents.planner import (
    PlanConfig,
    complete_newest_first,
    make_plan,
    take_down_to,
)
from megatron_ext.incidents.report import build_report
from tests.support.checkpoints import write_loadable_checkpoint
from tests.support.io_counters import rchar
from tests.support.spike_curves import events, records

STUCK_AT = 0.9  # the spike's place in the run, as a fraction of its length


def _run(work: Path, length: int, every: int, broken: int) -> tuple[Path, Path]:
    """Attempt 1 trains 1..length and spikes for good at 0.9 x length; attempt 2 resumes
    from the checkpoint 100 before the spike and spikes again at the same iteration; the
    checkpoint of iteration ``broken`` never finished."""
    spike = int(length * STUCK_AT)
    stuck = {i: (5.0, 6.0 if i == spike else 1.0) for i in range(spike, length + 1)}
    signals, ckpt = work / "signals", work / "ckpt"
    ledger = JsonlAppender(signals / "spikes.jsonl")
    for attempt, first in ((1, 1), (2, spike - 99)):
        timeline = records(length, stuck, attempt=attempt, seed=attempt)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            writer = SignalsWriter(signals)
        for record in timeline[first - 1 :]:
            writer.write(record)
        for event in events(timeline):
            ledger.append(event.as_json())
    for iteration in range(every, length + 1, every):
        if iteration != broken:
            write_loadable_checkpoint(ckpt / f"iter_{iteration:07d}")
        else:
            (ckpt / f"iter_{iteration:07d}").mkdir(parents=True)
    return signals, ckpt


def _plan(signals: Path, ckpt: Path, *flags: str) -> dict:
    argv = ["--ckpt-dir", str(ckpt), "--signals-dir", str(signals), "--no-lookup", *flags]
    assert cli.main(argv) == 0
    return json.loads((ckpt / "megatron_ext_incidents" / "incident-001.json").read_text())


def test_the_plan_is_the_full_scan_s_plan_across_a_restart(tmp_path: Path) -> None:
    signals, ckpt = _run(tmp_path, 400, 10, broken=320)
    flags = ["--train-iters", "1000", "--skip-batches", "150", "--rollback-iters", "40"]
    got = _plan(signals, ckpt, *flags)
    # What the planner did before: every record of the log, every checkpoint checked.
    ledger = read_jsonl(signals / "spikes.jsonl").records
    history = read_signals(signals / "signals.jsonl")
    checkpoints = [
        int(p.name[5:]) for p in sorted(ckpt.glob("iter_*")) if (p / "metadata.json").exists()
    ]
    assert take_down_to(complete_newest_first(ckpt), None) == checkpoints
    plan = make_plan(ledger, history, checkpoints, [], PlanConfig(40, 150), 1000, str(ckpt))
    expected = build_report(plan, ledger, history, ckpt, 1, None).as_json()
    got.pop("incident_id")
    assert got == json.loads(json.dumps(json_safe(expected)))
    assert got["incident"]["attempt"] == 2 and got["rollback_to"] == 310  # 320 never finished
    assert {r.attempt for r in history if r.iteration == 360} == {1, 2}


def test_the_plan_reads_a_small_part_of_a_long_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    signals, ckpt = _run(tmp_path, 20_000, 10, broken=17_900)
    size = (signals / "signals.jsonl").stat().st_size
    monkeypatch.setattr(cli, "ONSET_LOOKBACK", 300)  # the stretch a plan reads, made small
    checked = []
    complete = planner._complete
    monkeypatch.setattr(planner, "_complete", lambda d: checked.append(d.name) or complete(d))
    verified = []
    problem = cli.checkpoint_problem
    monkeypatch.setattr(cli, "checkpoint_problem", lambda d: verified.append(d.name) or problem(d))
    before = rchar()
    got = _plan(signals, ckpt, "--train-iters", "30000", "--skip-batches", "300")
    read = rchar() - before
    assert got["onset"] == 18_000 and got["rollback_to"] == 17_890  # 17_900 never finished
    # A full scan reads all of it; the seek reads the stretch, a few probes, the small files.
    assert read < size / 10, (read, size)
    # 2,000 checkpoint directories: only those a plan can use are checked (down to the
    # newest complete one below the earliest onset the stretch read allows: 17_705 - 100).
    assert len(list(ckpt.glob("iter_*"))) == 2000
    assert checked == [f"iter_{i:07d}" for i in range(20_000, 17_595, -10)]
    assert verified == ["iter_0017890"]  # loaded-checkpoint checks: the target alone
