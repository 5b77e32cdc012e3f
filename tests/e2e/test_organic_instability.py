"""Instabilities that arise by themselves in Megatron's real loop (the fixed cases of
``benchmarks/instability.py``, BENCHMARKS.md "Instabilities"): small GPTs at high learning
rates with no weight decay, Wortsman et al. 2023's recipe. Nothing is injected.

- Attention-logit growth (the sweep's model at learning rate 0.3, its first 90 steps): the max
  attention logit explodes while the loss stalls and the grad norm climbs; the early warning
  says so (ledger kind ``warning``), without a rollback. With ``--qk-layernorm`` the same run
  learns and nothing warns.
- A blow-up (the tiny model at learning rate 2): the detector rolls back, and the incident
  report has its early-warning line. Nothing prevents this one at CPU scale (the sweep: every
  arm fails at lr 1, z-loss and qk-layernorm included), so no arm is asserted to.

Both are chaotic: which precursor warns first, when, by how much, and at lr 1 whether the run
blows up at all, differ between CPU families (issue #43). The tests assert what the rules
promise, and were run under other kernels of this machine's torch and MKL
(``ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2``, ``...=avx2 ...=AVX2``):
at lr 1 one of those recovered without a rollback; at lr 2 every one rolled back.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megatron_ext.common import exit_codes
from megatron_ext.common.files import SPIKE_LEDGER_FILE
from megatron_ext.common.records.signals import read_signals
from megatron_ext.common.records.spike_config import ATTENTION_LOGIT_LIMIT, SpikeConfig
from megatron_ext.spikes.precursors import PRECURSORS, WarnConfig, replay
from tests.support.harness import TINY_MODEL, Run, launch, run_skiplist


def _training(iters: int, warmup: int, lr: float) -> list[str]:
    """The sweep's optimizer: AdamW (beta2 0.95), clip 1, warm-up then cosine, no decay."""
    return [
        *("--micro-batch-size", "8", "--global-batch-size", "8"),
        *("--train-iters", str(iters), "--lr-warmup-iters", str(warmup)),
        *("--lr", str(lr), "--min-lr", "1e-5", "--lr-decay-style", "cosine"),
        *("--adam-beta1", "0.9", "--adam-beta2", "0.95", "--adam-eps", "1e-8"),
        *("--weight-decay", "0", "--clip-grad", "1.0", "--seed", "1234"),
        *("--log-interval", "10", "--eval-iters", "0", "--eval-interval", "1000"),
    ]


def _detector(window: int) -> list[str]:
    """The detector (and the warning's windows, which follow it) at a short run's scale."""
    return [
        *("--spike-detect", "--spike-window", str(window), "--spike-warmup", str(window)),
        *("--spike-patience", "5", "--log-output-z", "--signals-attention-logit"),
    ]


def _events(work: Path) -> list[dict]:
    lines = (work / "signals" / SPIKE_LEDGER_FILE).read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("kind") != "config"]


def _growth(work: Path, data_args: list[str], *extra: str) -> Run:
    """The sweep's model (hidden 128) at lr 0.3, its 600-step schedule, stopped at 90."""
    model = list(TINY_MODEL)
    model[model.index("--hidden-size") + 1] = "128"
    flags = [*data_args, *_detector(20), "--signals-dir", str(work / "signals")]
    flags += ["--exit-interval", "90", *extra]
    run = launch(work, flags, model=model, training=_training(600, 60, 0.3), sample_log=False)
    assert run.returncode == 0, run.log[-3000:]
    return run


def _past_its_threshold(warning: dict) -> bool:
    """What the rule promises of any warning: its signal moved by at least its own rise
    (a ratio for the logarithmic signals, nats for log Z) and past its floor, if any."""
    p = next(p for p in PRECURSORS if p.field == warning["signal"])
    value, reference = warning["value"], warning["reference"]
    drift = math.log(value / reference) if p.log else abs(value - reference)
    floor = p.floor is None or value >= p.floor
    return drift >= p.rise * (1 - 1e-9) and floor


def test_attention_logit_growth_warns_and_qk_layernorm_prevents_it(tmp_path, data_args) -> None:
    """Asserts what the early-warning rule promises, not one CPU's trajectory: which precursor
    warns first, when and by how much differs between CPU families (issue #43: on an Intel
    Xeon the attention logit warned first at 1.64x; on an AMD EPYC the grad norm at 3x)."""
    _growth(tmp_path / "plain", data_args)
    events = _events(tmp_path / "plain")
    warnings = [e for e in events if e["kind"] == "warning"]
    assert warnings, "the logit growth ran 90 steps without an early warning"
    assert "rollback" not in {e["kind"] for e in events}
    assert all(_past_its_threshold(w) for w in warnings), warnings
    # Each warning is the rule applied to the run's own signals log.
    records = read_signals(tmp_path / "plain" / "signals" / "signals.jsonl")
    config = WarnConfig.following(SpikeConfig(window=20, warmup=20, patience=5))
    offline = {(w.iteration, w.signal): (w.value, w.reference) for w in replay(records, config)}
    for w in warnings:
        assert offline[w["iteration"], w["signal"]] == pytest.approx((w["value"], w["reference"]))
    plain = {r.iteration: r for r in records}[90]
    assert plain.max_attention_logit > ATTENTION_LOGIT_LIMIT  # the logit growth behind it
    _growth(tmp_path / "qk", data_args, "--qk-layernorm")
    qk_events = _events(tmp_path / "qk")
    assert not [e for e in qk_events if e.get("signal") == "max_attention_logit"], qk_events
    assert "rollback" not in {e["kind"] for e in qk_events}
    healthy = read_signals(tmp_path / "qk" / "signals" / "signals.jsonl")[-1]
    assert healthy.iteration == 90 and healthy.max_attention_logit < ATTENTION_LOGIT_LIMIT
    assert healthy.lm_loss < plain.lm_loss  # the same run learns where the plain one stalled


def _blow_up(work: Path, data_args: list[str], *extra: str) -> Run:
    flags = [*data_args, *_detector(10), "--signals-dir", str(work / "signals"), *extra]
    flags += ["--save", str(work / "ckpt"), "--save-interval", "5"]
    return launch(work, flags, training=_training(60, 30, 2.0), sample_log=False)


@pytest.fixture(scope="module")
def blow_up(tmp_path_factory, data_args) -> Path:
    work = tmp_path_factory.mktemp("organic-blow-up")
    run = _blow_up(work, data_args)
    assert run.exits()[0].get("exit_code") == exit_codes.SPIKE_ROLLBACK, run.log[-3000:]
    return work


def test_a_blow_up_rolls_back_with_the_warning_line_in_its_report(blow_up: Path) -> None:
    rollback = next(e for e in _events(blow_up) if e["kind"] == "rollback")
    plan = run_skiplist(blow_up, "--rollback-iters", "5", "--skip-batches", "20", "--no-lookup")
    assert plan.returncode == 0, plan.stdout + plan.stderr
    incidents = blow_up / "ckpt" / "megatron_ext_incidents"
    report = json.loads((incidents / "incident-001.json").read_text())
    before = [w for w in report["early_warnings"] if w["iteration"] <= rollback["onset"]]
    lead = rollback["onset"] - min(w["iteration"] for w in before) if before else None
    assert report["lead_time"] == lead
    assert "- early warning: " in (incidents / "incident-001.md").read_text()
