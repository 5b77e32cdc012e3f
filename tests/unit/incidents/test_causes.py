"""Seed 000's decision tree over recorded signals, and the incident report that shows it.

Signals are synthetic (``spike_curves``); the injected fingerprints on real curves are in
test_detector_curves.py.
"""

from __future__ import annotations

from pathlib import Path

from megatron_ext.incidents.causes import LOOKBACK, diagnose
from megatron_ext.incidents.planner import PlanConfig, make_plan
from megatron_ext.incidents.report import build_report, culprit_first
from tests.support.spike_curves import records as _records

ONSET = 1200


def _incident(kind: str = "rollback") -> dict:
    return {
        "kind": kind,
        "iteration": ONSET + 5,
        "onset": ONSET,
        "attempt": 1,
        "culprit_dp_rank": 3,
        "classification": "large loss jump; not recovered",
        "grad_baseline": 1.0,
        "loss_threshold": 3.3,
        "loss": 5.0,
        "loss_baseline": 3.0,
        "consumed_samples": 8 * (ONSET + 5),
        "window": [],
    }


def _run(spike: dict | None = None):
    records = _records(ONSET + 10, spike or {ONSET: (5.0, 6.0), ONSET + 1: (3.0, 1.0)})
    for r in records:
        r.max_local_loss, r.max_loss_dp_rank = r.lm_loss + 0.05, 0
        r.params_norm = 100 + 0.01 * r.iteration
        r.max_attention_logit, r.num_zeros = 35.0 + (r.iteration % 3), 1000.0
    return records


def _answers(diagnosis) -> dict[str, str]:
    return {s.name: s.answer for s in diagnosis.steps}


def test_nothing_recorded_beyond_the_loss_means_unknowns_and_a_list_of_what_to_record() -> None:
    records = _records(ONSET + 10, {ONSET: (5.0, 6.0)})
    for r in records:
        r.grad_norm = r.max_local_loss = None
    d = diagnose(_incident(), records)
    assert _answers(d) == {
        "divergence": "yes",
        "attention-logit": "unknown",
        "learning-rate": "unknown",
        "bad-data": "unknown",
        "straggler": "unknown",
        "optimizer-state": "unknown",
        "bf16": "unknown",  # back the next step, but num_zeros was not recorded
    }
    assert d.cause == "transient" and d.action.startswith("roll back first")
    assert "slowest_rank (signals: --signals-dir, DP > 1)" in d.missing
    assert "max_attention_logit (--log-max-attention-logit)" in d.missing
    assert "max_local_loss (telemetry --signals-dir)" in d.missing


def test_one_rank_far_above_the_average_is_bad_data_on_that_rank() -> None:
    records = _run()
    records[ONSET - 1].max_local_loss, records[ONSET - 1].max_loss_dp_rank = 9.0, 3
    d = diagnose(_incident(), records, reproduced=True)
    assert d.cause == "bad-data" and d.culprit_dp_rank == 3
    assert "reproduced at the same onset" in d.steps[3].evidence


def _timed(records, named_from: int | None) -> None:
    """Every step's slowest rank (2, on node-2); named a straggler from ``named_from``."""
    for r in records:
        r.slowest_rank, r.slowest_step_time, r.median_step_time = 2, 1.1, 1.0
        if named_from is not None and r.iteration >= named_from:
            r.straggler_rank, r.straggler_node = 2, "node-2"
            r.slowest_step_time = 3.0


def test_a_straggler_named_at_the_onset_is_the_cause_with_its_node(tmp_path: Path) -> None:
    records = _run()
    _timed(records, named_from=ONSET - 3)
    d = diagnose(_incident(), records)
    assert d.cause == "straggler" and d.steps[4].name == "straggler"
    assert d.steps[4].evidence.startswith(f"rank 2 on node-2 named at iteration {ONSET - 3}")
    ledger = [_incident()]
    plan = make_plan(ledger, records, [ONSET - 200], [], PlanConfig(), None, str(tmp_path))
    text = build_report(plan, ledger, records, tmp_path, 1, worst=None).markdown()
    assert "- likely cause: **a straggling rank at the onset (a slow or failing node)**" in text
    assert "rank 2 on node-2 named at iteration" in text


def test_a_straggler_long_gone_or_none_is_not_the_cause() -> None:
    for named_from in (None, ONSET + 100):  # never; only after the incident
        records = _run()
        _timed(records, named_from)
        d = diagnose(_incident(), records)
        assert _answers(d)["straggler"] == "no" and d.cause != "straggler"
        assert "none named over iterations" in d.steps[4].evidence


def test_a_steadily_rising_max_logit_past_100_is_named_first() -> None:
    records = _run()
    for r in records[ONSET - 200 : ONSET]:
        r.max_attention_logit = 40 + 0.4 * (r.iteration - (ONSET - 200))
    assert diagnose(_incident(), records).cause == "attention-logit"


def test_faster_params_norm_growth_and_a_rising_grad_norm_is_the_learning_rate() -> None:
    records = _run()
    for r in records[ONSET - 100 : ONSET]:
        r.params_norm += 0.05 * (r.iteration - (ONSET - 100))
        r.grad_norm *= 1.6
    assert diagnose(_incident(), records).cause == "learning-rate"


def test_a_grad_norm_plateau_below_normal_is_the_optimizer_state() -> None:
    records = _run()
    for r in records[ONSET - 100 : ONSET]:
        r.grad_norm *= 0.5
    assert diagnose(_incident(), records).cause == "optimizer-state"


def test_no_precursor_back_next_step_and_num_zeros_off_is_bf16() -> None:
    records = _run()
    records[ONSET - 1].num_zeros = 3000.0
    d = diagnose(_incident("spike"), records)
    assert (d.cause, d.diverged) == ("bf16", False)
    assert LOOKBACK >= 1000  # the precursor questions see a "normal" stretch


def test_the_report_shows_the_walk_and_orders_the_culprit_first(tmp_path: Path) -> None:
    records = _run()
    records[ONSET - 1].max_local_loss, records[ONSET - 1].max_loss_dp_rank = 9.0, 3
    ledger = [_incident("spike"), _incident()]
    plan = make_plan(ledger, records, [ONSET - 200], [], PlanConfig(), None, str(tmp_path))
    report = build_report(plan, ledger, records, tmp_path, 1, worst=None)
    text = report.markdown()
    assert "- likely cause: **single-rank bad data** (diverged)" in text
    assert (
        "| bad-data | worst DP rank's loss far above the DP average at the onset? | **yes** |"
        in text
    )
    assert "not available: not looked up (--no-lookup)" in text
    assert report.as_json()["diagnosis"]["cause"] == "bad-data"
    assert "--worst 8 --text --emit-blocklist" in report.blocklist_command()
    samples = [{"dp_rank": r, "rank_by_loss": k} for k, r in enumerate([0, 3, 1, 3], start=1)]
    assert [s["dp_rank"] for s in culprit_first(samples, 3)] == [3, 3, 0, 1]


def test_one_sources_own_jump_is_bad_data_in_that_source() -> None:
    """A 10 % source jumps +60 % at the onset; every rank alike (no single-rank excess)."""
    records = _run({ONSET: (3.2, 1.1)})
    for r in records:
        code = 4.0 * (1.6 if ONSET <= r.iteration <= ONSET + 2 else 1.0)
        r.lm_loss_by_dataset = {"prose": 3.0, "code": code}
        r.tokens_by_dataset = {"prose": 900, "code": 100}
    d = diagnose({**_incident("spike"), "culprit_source": "code"}, records)
    assert _answers(d)["bad-data"] == "yes"
    assert d.cause == "bad-source" and d.culprit_source == "code"
    (step,) = [s for s in d.steps if s.name == "bad-data"]
    assert "source code: 6.4 at iteration" in step.evidence and "+60%" in step.evidence
    assert "its share 10% of the tokens" in step.evidence
    # Both sources up alike: a general rise, not one source's bad data.
    for r in records:
        r.lm_loss_by_dataset = {k: v * 1.5 for k, v in r.lm_loss_by_dataset.items()}
        if ONSET <= r.iteration <= ONSET + 2:
            r.lm_loss_by_dataset["prose"] *= 1.6
    d = diagnose(_incident("spike"), records)
    assert d.culprit_source is None and d.cause != "bad-source"


def test_the_report_gives_the_lead_time_of_a_precursor_warning(tmp_path: Path) -> None:
    records = _run()
    warning = {"kind": "warning", "iteration": ONSET - 310, "attempt": 1, "signal": "log_z"}
    warning["classification"] = "early warning: log_z falling for 10+ steps"
    ledger = [
        {**warning, "iteration": ONSET - 2000},  # an old episode: not this incident's
        {**warning, "attempt": 0},  # another attempt's
        warning,
        {**warning, "iteration": ONSET - 20, "signal": "grad_norm"},
        _incident("spike"),
        _incident(),
    ]
    plan = make_plan(ledger, records, [ONSET - 200], [], PlanConfig(), None, str(tmp_path))
    report = build_report(plan, ledger, records, tmp_path, 1, worst=None)
    assert report.lead_time() == 310
    assert "- early warning: **310 iterations before the onset** (log_z at iteration" in (
        report.markdown()
    )
    assert report.as_json()["lead_time"] == 310
    assert len(report.as_json()["early_warnings"]) == 2
    quiet = build_report(plan, ledger[-2:], records, tmp_path, 1, worst=None)
    assert quiet.lead_time() is None
    assert "- early warning: none in the 1000 iterations before the onset" in quiet.markdown()


def test_a_short_run_is_too_short_for_the_history_questions_not_missing_its_grad_norms() -> None:
    """The demo's drill spikes at iteration 40: its grad norms are recorded, the 200
    iterations the history questions compare are not there. The report said "grad_norm
    history" under the signals the run did not record; it names the iterations now."""
    onset = 40
    records = _records(onset + 10, {onset: (5.0, 6.0), onset + 1: (3.0, 1.0)})
    for r in records:
        r.params_norm = 100 + 0.01 * r.iteration
    incident = {**_incident(), "onset": onset, "iteration": onset + 5}
    d = diagnose(incident, records)
    assert not [m for m in d.missing if "grad_norm" in m or "params_norm" in m], d.missing
    steps = {s.name: s for s in d.steps}
    for name in ("learning-rate", "optimizer-state"):
        assert steps[name].answer == "unknown"
        assert steps[name].evidence.startswith("only 39 iteration(s) before the onset")
    for r in records:
        r.grad_norm = None  # not recorded at all: named, with how to record it
    assert "grad_norm (signals: --signals-dir)" in diagnose(incident, records).missing


def test_the_report_names_the_layer_whose_grad_norm_rose_first(tmp_path: Path) -> None:
    """--log-layer-norms: the lowest layer's grad norm rose 30 iterations before the onset,
    the next one 10 before: the report names the first; without them, 'not recorded'."""
    records = _run()
    for r in records:
        r.layer_grad_norms = {"decoder.layers.0": 0.5, "decoder.layers.1": 0.5, "output_layer": 1}
        if ONSET - 30 <= r.iteration <= ONSET:
            r.layer_grad_norms["decoder.layers.0"] = 2.0
        if ONSET - 10 <= r.iteration <= ONSET:
            r.layer_grad_norms["decoder.layers.1"] = 4.0
    assert diagnose(_incident(), records).first_layer == (
        f"decoder.layers.0 (iteration {ONSET - 30}, x4)"
    )
    ledger = [_incident("spike"), _incident()]
    plan = make_plan(ledger, records, [ONSET - 200], [], PlanConfig(), None, str(tmp_path))
    text = build_report(plan, ledger, records, tmp_path, 1, worst=None).markdown()
    assert f"- layer whose grad norm rose first: decoder.layers.0 (iteration {ONSET - 30}" in text
    assert diagnose(_incident(), _run()).first_layer is None
