"""The detector on the real curves of ``benchmarks/curves`` (the benchmark's claims, kept).

Real incident excerpts are replayed as published with every detector's warm-up lowered to the
points each excerpt has before its onset (the benchmark's "as published" protocol); the clean
runs are replayed whole with the defaults. A few SYNTHETIC injections check that the incident
names the cause it was built with. About a second in all.
"""

from __future__ import annotations

import pytest

from benchmarks.curves import load_curves
from benchmarks.detector import ALL, WITHIN, incidents, records_of, run
from benchmarks.fingerprints import EXPECTED_CAUSE, FINGERPRINTS, cases
from megatron_ext.common.records.spike_config import SpikeConfig
from megatron_ext.incidents.causes import diagnose
from megatron_ext.spikes.detector import replay

DEFAULTS = SpikeConfig()


@pytest.fixture(scope="module")
def published() -> list[dict]:
    return incidents(DEFAULTS, primed=False)


def test_every_real_incident_is_flagged_within_two_logged_points(published) -> None:
    ours = [r for r in published if r["detector"] == "this detector"]
    assert len(ours) == sum(len(c.onsets) for c in load_curves("incident")) >= 10
    missed = [(r["curve"], r["onset"]) for r in ours if r["delay"] is None]
    assert not missed
    assert all(0 <= r["delay"] <= WITHIN for r in ours)


def test_no_anchor_catches_more_real_incidents(published) -> None:
    recall = {n: sum(r["delay"] is not None for r in published if r["detector"] == n) for n in ALL}
    assert all(recall["this detector"] >= recall[n] for n in ALL), recall


@pytest.mark.parametrize("curve", load_curves("clean"), ids=lambda c: c.name)
def test_no_rollback_on_a_long_clean_run(curve) -> None:
    events = replay(records_of(curve), DEFAULTS)
    assert [e for e in events if e.kind in ("rollback", "divergence")] == []
    # Heavy-tailed one-step outliers may be flagged, and must then recover.
    spikes = [e for e in events if e.kind == "spike"]
    assert len([e for e in events if e.kind == "recovered"]) == len(spikes)


def test_the_outliers_the_sources_name_recover_without_a_rollback() -> None:
    curve = next(c for c in load_curves("clean") if c.name == "modded_nanogpt_scaleup_1p5b")
    events = replay(records_of(curve), DEFAULTS)
    around = [e for e in events if 5960 <= e.iteration <= 5970]
    assert [e.kind for e in around] == ["spike", "recovered"]  # 3.00 -> 5.70 -> 3.32


def test_injected_fingerprints_are_flagged_and_named() -> None:
    curve = next(c for c in load_curves("clean") if c.name == "llmc_gpt2_124m_main")
    named = {}
    for case in cases([curve], per_fingerprint=1):
        index = next(i for i, r in enumerate(case.records) if r.iteration == case.onset)
        outcome = run("this detector", case.records, DEFAULTS, None)
        first = outcome.first_from(index)
        assert first is not None and first - index <= WITHIN, case.name
        mine = [e for i, e in outcome.events if i >= index]
        decided = next((e for e in mine if e.kind == "rollback"), mine[0])
        upto = [r for r in case.records if r.iteration <= decided.iteration + 1]
        named[case.fingerprint] = diagnose(decided.as_json(), upto).cause
    assert named == {f: EXPECTED_CAUSE[f] for f in FINGERPRINTS}
