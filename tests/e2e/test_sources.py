"""Per-source signals and the detector's per-source baselines in the real loop, on two real,
different sources: the demo's prose and Python's standard library source code (one BPE).

Launches (DP=2, the tiny model, 32 samples a step; shared by the module's tests):

- **stage 1**: prose 90 %, code 10 %, iterations 1-30 (checkpoint 30);
- **stage 2** (a stage change): resumes stage 1 with the weights inverted, 31-42: the average
  loss moves, no incident;
- **bad source**: resumes a copy of stage 1 with the same mixture and the code source's
  samples replaced by garbage at 36-38 on every rank (10 % of the batch): flagged at its
  onset, the source named, rolled back (checkpoint 35) and the three iterations skipped; the
  restart trains on to 42 clean.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatron_ext.common.files import SIGNALS_FILE, SPIKE_LEDGER_FILE
from megatron_ext.common.records.signals import SignalRecord, latest_per_iteration, read_signals
from megatron_ext.common.records.spike_config import SpikeConfig
from megatron_ext.spikes.detector import replay
from tests.support.harness import Run, launch, run_skiplist
from tests.support.sources import CODE, PROSE, blend_args, prepare_sources

STAGE, END, BAD = 30, 42, (36, 38)
TOKENS = 32 * 64  # global batch x sequence length: every token is a loss token
STAGE_1, STAGE_2 = {PROSE: 0.9, CODE: 0.1}, {PROSE: 0.1, CODE: 0.9}
# A tiny run's detector: short windows, tight thresholds (the defaults are for long runs).
DETECTOR = {
    "window": 8,
    "warmup": 8,
    "loss_rel": 0.05,
    "mad_k": 3.0,
    "large_rel": 0.15,
    "large_mad_k": 6.0,
    "patience": 2,
}
DETECTOR_FLAGS = [
    x for k, v in DETECTOR.items() for x in (f"--spike-{k.replace('_', '-')}", str(v))
]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> tuple[dict[str, str], list[str], Path]:
    root = tmp_path_factory.mktemp("sources")
    prefixes, tokenizer = prepare_sources(root)
    return prefixes, tokenizer, root


def _args(sources, work: Path, weights: dict[str, float], save: int) -> list[str]:
    prefixes, tokenizer, root = sources
    return [
        *blend_args(prefixes, weights, root / "index-cache"),
        *tokenizer,
        "--global-batch-size",
        "32",
        "--micro-batch-size",
        "4",
        "--train-iters",
        "45",
        "--lr",
        "3e-3",
        "--min-lr",
        "1e-4",
        # Decayed by 22: stage 1 ends on a flat stretch, where the detector's baseline is tight.
        "--lr-decay-iters",
        "22",
        "--signals-dir",
        str(work / "signals"),
        "--spike-detect",
        *DETECTOR_FLAGS,
        "--save",
        str(work / "ckpt"),
        "--load",
        str(work / "ckpt"),
        "--save-interval",
        str(save),
    ]


def _ok(run: Run) -> Run:
    assert run.returncode == 0, run.log[-4000:]
    return run


def _copy(run: Run, work: Path) -> Path:
    for part in ("ckpt", "signals"):
        shutil.copytree(run.workdir / part, work / part)
    return work


@pytest.fixture(scope="module")
def stage1(sources, tmp_path_factory) -> Run:
    work = tmp_path_factory.mktemp("stage1")
    args = [*_args(sources, work, STAGE_1, STAGE), "--exit-interval", str(STAGE)]
    return _ok(launch(work, args, nproc=2, sample_log=False))


@pytest.fixture(scope="module")
def stage2(sources, stage1, tmp_path_factory) -> Run:
    work = _copy(stage1, tmp_path_factory.mktemp("stage2"))
    args = [*_args(sources, work, STAGE_2, 100), "--exit-interval", str(END)]
    return _ok(launch(work, args, nproc=2, sample_log=False))


@pytest.fixture(scope="module")
def bad_source(sources, stage1, tmp_path_factory):
    work = _copy(stage1, tmp_path_factory.mktemp("bad-source"))
    args = [
        *_args(sources, work, STAGE_1, 5),
        "--exit-interval",
        str(END),
        "--drill-corrupt-batch",
        f"{BAD[0]}-{BAD[1]}:*",
        "--drill-corrupt-source",
        CODE,
    ]
    first = launch(work, args, nproc=2, sample_log=False)
    plan = run_skiplist(work, "--rollback-iters", "1", "--skip-batches", "3", "--apply")
    restart = launch(work.parent / f"{work.name}-restart", args, nproc=2, sample_log=False)
    return work, first, plan, restart


def _records(work: Path) -> list[SignalRecord]:
    return latest_per_iteration(read_signals(work / "signals" / SIGNALS_FILE))


def _events(work: Path) -> list[dict]:
    lines = (work / "signals" / SPIKE_LEDGER_FILE).read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("kind") != "config"]


def test_every_record_has_per_source_fields_consistent_with_lm_loss(stage1: Run) -> None:
    records = _records(stage1.workdir)
    assert [r.iteration for r in records] == list(range(1, STAGE + 1))
    for r in records:
        assert set(r.tokens_by_dataset) == {PROSE, CODE}, r.iteration
        assert sum(r.tokens_by_dataset.values()) == TOKENS
        assert set(r.lm_loss_by_dataset) == {n for n, t in r.tokens_by_dataset.items() if t}
        mean = sum(r.lm_loss_by_dataset[n] * t for n, t in r.tokens_by_dataset.items() if t)
        assert mean / TOKENS == pytest.approx(r.lm_loss, rel=1e-5), r.iteration
    share = sum(r.tokens_by_dataset[CODE] for r in records) / (TOKENS * len(records))
    assert 0.05 < share < 0.15  # the blend's 10 %
    # The sources are really different: code is harder for a BPE trained on prose.
    late = records[-5:]
    assert min(r.lm_loss_by_dataset[CODE] - r.lm_loss_by_dataset[PROSE] for r in late) > 0.3
    assert f"| lm loss by dataset | {PROSE}: " in stage1.log


def test_a_stage_change_moves_the_average_and_starts_no_incident(stage1, stage2) -> None:
    records = _records(stage2.workdir)
    assert [r.iteration for r in records] == list(range(1, END + 1))
    before, after = records[STAGE - 5 : STAGE], records[STAGE : STAGE + 5]
    mean = lambda rs, f: sum(f(r) for r in rs) / len(rs)
    moved = mean(after, lambda r: r.lm_loss) / mean(before, lambda r: r.lm_loss) - 1
    assert moved > DETECTOR["loss_rel"], "the average moved by more than the threshold"
    code_share = mean(after, lambda r: r.tokens_by_dataset[CODE] / TOKENS)
    assert code_share > 0.8
    assert _events(stage2.workdir) == []
    # Judged on the average alone the same records are an incident: the test can fail.
    aggregate = SpikeConfig(**DETECTOR, per_source=False)
    flagged = [e for e in replay(records, aggregate) if e.kind in ("spike", "divergence")]
    assert flagged and flagged[0].onset == STAGE + 1


def test_a_bad_source_at_10_percent_is_flagged_named_rolled_back_and_skipped(bad_source) -> None:
    work, first, plan, restart = bad_source
    exits = first.exits()
    assert {e["exit_code"] for e in exits.values()} == {42} and len(exits) == 2, first.log[-4000:]
    events = _events(work)
    assert events[0]["kind"] == "spike" and events[0]["onset"] == BAD[0]
    assert events[0]["culprit_source"] == CODE
    assert events[0]["classification"] == f"large loss jump of source {CODE}"
    assert events[-1]["kind"] == "rollback" and events[-1]["culprit_source"] == CODE
    # The average hid it: judged on the average alone, nothing is flagged.
    records = [r for r in _records(work) if r.iteration <= BAD[1]]
    assert replay(records, SpikeConfig(**DETECTOR, per_source=False)) == []
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert f"culprit source {CODE}" in plan.stdout
    report = next((work / "ckpt").rglob("incident-*.md")).read_text()
    assert f"- culprit source (its own loss jumped): {CODE}" in report
    assert "- likely cause: **bad data in one source**" in report
    _ok(restart)
    final = _records(work)
    assert [r.iteration for r in final] == list(range(1, END + 1))
    after = [r for r in final if r.iteration > BAD[1]]  # trained by the restart
    assert {r.attempt for r in after} == {events[0]["attempt"] + 1}
    retrained = [r.iteration for r in read_signals(work / "signals" / SIGNALS_FILE)]
    assert retrained.count(BAD[0]) == 1, "the skipped iterations are not trained again"
    assert _events(work)[len(events) :] == []  # the restart is clean
    clean = [r.lm_loss_by_dataset.get(CODE) for r in after]
    assert max(v for v in clean if v is not None) < events[0]["source_loss"]
