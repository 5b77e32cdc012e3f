"""Instabilities that arise by themselves in Megatron's real loop (the fixed cases of
``benchmarks/instability.py``, BENCHMARKS.md "Instabilities"): small GPTs at high learning
rates with no weight decay, Wortsman et al. 2023's recipe. Nothing is injected.

- Attention-logit growth (the sweep's model at learning rate 0.3, its first 90 steps): the max
  attention logit explodes while the loss stalls and the grad norm climbs; the early warning
  says so (ledger kind ``warning``), without a rollback. With ``--qk-layernorm`` the same run
  learns and nothing warns.
- A blow-up (the tiny model at learning rate 1): the detector rolls back, and the incident
  report has its early-warning line. Nothing prevents this one at CPU scale (the sweep: every
  arm fails at lr 1, z-loss and qk-layernorm included), so no arm is asserted to: a
  ``--z-loss-coeff 1e-4`` run that once happened to recover rolled back on another CPU
  (the trajectory at lr 1 is chaotic; the float rounding of another instruction set is enough).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_ext.common import exit_codes
from megatron_ext.common.files import SPIKE_LEDGER_FILE
from megatron_ext.common.records.signals import read_signals
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


def test_attention_logit_growth_warns_and_qk_layernorm_prevents_it(tmp_path, data_args) -> None:
    _growth(tmp_path / "plain", data_args)
    warnings = [e for e in _events(tmp_path / "plain") if e["kind"] == "warning"]
    assert warnings and "rollback" not in {e["kind"] for e in _events(tmp_path / "plain")}
    assert warnings[0]["value"] >= 2 * warnings[0]["reference"]
    signals = {
        r.iteration: r for r in read_signals(tmp_path / "plain" / "signals" / "signals.jsonl")
    }
    assert signals[90].max_attention_logit > 1e4  # the logit growth behind it
    _growth(tmp_path / "qk", data_args, "--qk-layernorm")
    assert _events(tmp_path / "qk") == []
    healthy = read_signals(tmp_path / "qk" / "signals" / "signals.jsonl")[-1]
    assert healthy.max_attention_logit < 100 and healthy.lm_loss < signals[90].lm_loss - 1


def _blow_up(work: Path, data_args: list[str], *extra: str) -> Run:
    flags = [*data_args, *_detector(10), "--signals-dir", str(work / "signals"), *extra]
    flags += ["--save", str(work / "ckpt"), "--save-interval", "5"]
    return launch(work, flags, training=_training(60, 30, 1.0), sample_log=False)


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
