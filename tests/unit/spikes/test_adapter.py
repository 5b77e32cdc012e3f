"""The spike feature's hooks in process, on a real gloo group of one rank: its decisions and
ledger are the core detector's on the same signals; while a spike is in progress it vetoes
checkpoints; a rollback decision exits with the spike exit code."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

import pytest

from megatron_ext.common.features import StepRecord
from megatron_ext.common.files import SIGNALS_FILE, SPIKE_LEDGER_FILE
from megatron_ext.common.io import read_jsonl
from megatron_ext.spikes.adapter import SpikeFeature
from tests.support import megatron_world as mw
from tests.support.spike_curves import CONFIG, events, records

SPIKE_AT = 41  # a sustained jump from here on: flagged, then never recovers
FLAGS = [
    "--spike-detect",
    f"--spike-window={CONFIG.window}",
    f"--spike-warmup={CONFIG.warmup}",
    f"--spike-patience={CONFIG.patience}",
    f"--spike-grad-factor={CONFIG.grad_factor}",
]


@pytest.fixture(scope="module")
def world():
    with mw.megatron_world():
        yield


@pytest.fixture
def sigterm():
    """A rollback ignores SIGTERM for good (the process is ending); the tests' process is not."""
    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)


def _feature(work: Path) -> SpikeFeature:
    parser = argparse.ArgumentParser()
    feature = SpikeFeature()
    feature.add_args(parser.add_argument_group("megatron-ext"))
    args = parser.parse_args(FLAGS)
    args.signals_dir, args.rank, args.world_size = str(work), 0, 1
    args.save, args.sample_log_dir = str(work / "ckpt"), None
    assert feature.enabled(args)
    feature.validate(args)
    feature.install(args)
    (work / SIGNALS_FILE).touch()  # telemetry's writer opened it at setup
    return feature


def _step(signals) -> StepRecord:
    record = StepRecord(
        signals.iteration, {}, 1e-3, 1.0, False, signals.grad_norm, None, None, None
    )
    record.signals = signals
    return record


def test_decisions_veto_checkpoints_then_exit_for_a_rollback(world, sigterm, tmp_path) -> None:
    curve = records(80, {i: (6.0, 5.0) for i in range(SPIKE_AT, 81)})
    expected = events(curve)
    assert [e.kind for e in expected][-1] == "rollback"
    feature = _feature(tmp_path)
    vetoed = []
    with pytest.raises(SystemExit) as exited:
        for signals in curve:
            feature.after_step(_step(signals))
            if not feature.on_checkpoint(signals.iteration):
                vetoed.append(signals.iteration)
    assert exited.value.code == 42
    rollback = expected[-1].iteration
    assert vetoed == list(range(SPIKE_AT, rollback))  # from the flag to the decision
    assert feature.decision == "rollback"
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN

    ledger = read_jsonl(tmp_path / SPIKE_LEDGER_FILE).records
    assert ledger[0]["kind"] == "config" and ledger[0]["iteration"] == 1
    assert ledger[1:] == [e.as_json() for e in expected]


def test_healthy_signals_never_veto(world, tmp_path) -> None:
    feature = _feature(tmp_path)
    for signals in records(60):
        feature.after_step(_step(signals))
        assert feature.on_checkpoint(signals.iteration)
    assert feature.decision == "healthy"
    assert [e["kind"] for e in read_jsonl(tmp_path / SPIKE_LEDGER_FILE).records] == ["config"]
