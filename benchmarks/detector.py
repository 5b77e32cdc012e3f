"""Spike detectors on real training curves: recall, delay, false alarms; ours vs the anchors.

    python benchmarks/detector.py               # the tables in BENCHMARKS.md ("detector")
    python benchmarks/detector.py --sweep       # + one-at-a-time sweep of the defaults

Detectors: this project's (``megatron_ext.spikes.detector``, default ``SpikeConfig``) and the
anchors of ``benchmarks/anchors.py`` with their sources' defaults (Megatron spiky loss 10x,
OLMo-core 6 sigma / 128, Lightning ``SpikeDetection``, ZClip z-score).

What counts (the same for every detector):

- **flagged**: the detector raises its alarm: ours emits a ``spike`` or ``divergence`` event
  (an incident starts: no checkpoint is written from then on); an anchor's rule returns True.
- **recall**: a labelled onset is flagged within 2 *logged* points of it (delay 0, 1 or 2).
- **false flags / false rollbacks per 100k steps**: on the clean curves (no incident). Ours
  rolls back only when a flagged spike did not recover within patience. The anchors have no
  recovery stage: used as the pipeline's trigger, each of their flags is a rollback.

Protocols (BENCHMARKS.md and benchmarks/curves/SOURCES.md say why):

- **as published** (real incident excerpts): each detector sees exactly the published points.
  The excerpts have 1-9 points before their first onset, so every detector's minimum history
  (warm-up, window fill, ZClip's warm-up, Megatron's 100 samples) is lowered to what the
  excerpt has before its first onset; nothing else changes.
- **primed** (semi-synthetic): 200 points of primer before the excerpt, with the *relative*
  noise of a real clean log (llm.c, steps 10000-10199, loss and grad norm each divided by
  their median) scaled to the excerpt's pre-onset median; then the published points. Default
  configs, no waiver. Flags in the primer are reported.
- **clean** (real): the five clean runs from their first step, default configs.
- **injected** (SYNTHETIC, ``benchmarks/fingerprints.py``): the five fingerprints of seed 000
  chapter 2 on top of the clean runs.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.anchors import (  # noqa: E402
    LightningSpikeDetection,
    MegatronSpikyLoss,
    OLMoCoreStabilityMonitor,
    ZClipZScore,
)
from benchmarks.curves import Curve, load_curve, load_curves  # noqa: E402
from benchmarks.fingerprints import EXPECTED_CAUSE, FINGERPRINTS, cases  # noqa: E402
from megatron_ext.common.records.signals import SignalRecord  # noqa: E402
from megatron_ext.common.records.spike_config import SpikeConfig  # noqa: E402
from megatron_ext.incidents.causes import diagnose  # noqa: E402
from megatron_ext.spikes.detector import SpikeDetector  # noqa: E402

WITHIN = 2  # logged points after the onset a flag may come
PRIMER = 200
ANCHORS = ("megatron 10x", "olmo-core 6s/128", "lightning", "zclip")
ALL = ("this detector", *ANCHORS)


def records_of(curve: Curve) -> list[SignalRecord]:
    """The curve's published values as signals records (nothing else filled in)."""
    return [
        SignalRecord(
            iteration=it,
            attempt=1,
            job_id=curve.name,
            wall_time=0.0,
            consumed_samples=it,
            skipped_samples=0,
            lm_loss=loss,
            grad_norm=grad,
            loss_scale=scale,
            skipped_iter=skipped,
        )
        for it, loss, grad, scale, skipped in zip(
            curve.iterations, curve.lm_loss, curve.grad_norm, curve.loss_scale, curve.skipped
        )
    ]


def anchor(name: str, history: int | None = None):
    """A fresh anchor; ``history``: its minimum history lowered to that many points."""
    if name == "megatron 10x":
        return MegatronSpikyLoss() if history is None else MegatronSpikyLoss(num_samples=history)
    if name == "olmo-core 6s/128":
        return (
            OLMoCoreStabilityMonitor()
            if history is None
            else OLMoCoreStabilityMonitor(window_size=history)
        )
    if name == "lightning":
        return LightningSpikeDetection()
    return ZClipZScore() if history is None else ZClipZScore(warmup_steps=max(1, history))


def waived(config: SpikeConfig, history: int) -> SpikeConfig:
    return replace(config, warmup=history, window=max(3, 2 * history))


@dataclass
class Outcome:
    flags: list[int]  # indices of flagged points
    rollbacks: list[int]
    events: list = None  # ours only

    def first_from(self, index: int) -> int | None:
        return next((i for i in self.flags if i >= index), None)


def run(name: str, records: list[SignalRecord], config: SpikeConfig, history: int | None):
    """Replay one detector; returns its flags (and, for ours, rollbacks and events)."""
    if name == "this detector":
        detector = SpikeDetector(config if history is None else waived(config, history))
        flags, rollbacks, events = [], [], []
        for index, record in enumerate(records):
            for event in detector.observe(record):
                events.append((index, event))
                if event.kind in ("spike", "divergence"):
                    flags.append(index)
                if event.kind == "rollback":
                    rollbacks.append(index)
            if detector.state == "rollback":  # replay on, as megatron_ext's replay() does
                detector.resume()
        return Outcome(flags, rollbacks, events)
    rule = anchor(name, history)
    flags = [
        i
        for i, r in enumerate(records)
        if rule.observe(r.iteration, r.lm_loss, None if r.skipped_iter else r.grad_norm) and True
    ]
    return Outcome(flags, list(flags))


def primer(curve: Curve, reference: Curve) -> list[SignalRecord]:
    """PRIMER points of the reference's relative noise at the excerpt's pre-onset level."""
    start = reference.iterations.index(10000)
    losses = reference.lm_loss[start : start + PRIMER]
    grads = reference.grad_norm[start : start + PRIMER]
    l_med, g_med = statistics.median(losses), statistics.median(grads)
    first = curve.iterations.index(curve.onsets[0])
    level = statistics.median(x for x in curve.lm_loss[:first] if math.isfinite(x))
    pre_grads = [g for g in curve.grad_norm[:first] if g is not None]
    g_level = statistics.median(pre_grads) if pre_grads else None
    step = curve.meta["log_interval"]
    out = []
    for k, (loss, grad) in enumerate(zip(losses, grads)):
        it = curve.iterations[0] - (PRIMER - k) * step
        out.append(
            SignalRecord(
                iteration=it,
                attempt=1,
                job_id="primer",
                wall_time=0.0,
                consumed_samples=it,
                skipped_samples=0,
                lm_loss=level * loss / l_med,
                grad_norm=None if g_level is None else g_level * grad / g_med,
                loss_scale=curve.loss_scale[0],
            )
        )
    return out


def incidents(config: SpikeConfig, primed: bool) -> list[dict]:
    """One row per (incident onset, detector)."""
    reference = load_curve("llmc_gpt2_124m_main")
    rows = []
    for curve in load_curves("incident"):
        records = records_of(curve)
        history = curve.iterations.index(curve.onsets[0])
        offset = 0
        if primed:
            head = primer(curve, reference)
            records, offset, history = head + records, len(head), None
        for name in ALL:
            outcome = run(name, records, config, history)
            early = [
                i - offset
                for i in outcome.flags
                if i < offset + curve.iterations.index(curve.onsets[0])
            ]
            for onset in curve.onsets:
                index = offset + curve.iterations.index(onset)
                first = outcome.first_from(index)
                delay = None if first is None or first - index > WITHIN else first - index
                rows.append(
                    {
                        "curve": curve.name,
                        "onset": onset,
                        "detector": name,
                        "delay": delay,
                        "early": len([e for e in early if e >= 0]),
                        "primer_flags": len([e for e in early if e < 0]),
                    }
                )
    return rows


def clean(config: SpikeConfig) -> dict[str, dict]:
    """False flags / rollbacks per detector over the real clean curves, and µs per step."""
    out = {
        name: {"steps": 0, "flags": 0, "rollbacks": 0, "seconds": 0.0, "per_curve": {}}
        for name in ALL
    }
    for curve in load_curves("clean"):
        records = records_of(curve)
        for name in ALL:
            start = time.perf_counter()
            outcome = run(name, records, config, None)
            elapsed = time.perf_counter() - start
            stats = out[name]
            stats["steps"] += len(records)
            stats["flags"] += len(outcome.flags)
            stats["rollbacks"] += len(outcome.rollbacks)
            stats["seconds"] += elapsed
            stats["per_curve"][curve.name] = (len(outcome.flags), len(outcome.rollbacks))
    return out


def injected(config: SpikeConfig, per_fingerprint: int) -> dict[tuple[str, str], dict]:
    """Per (fingerprint, detector): recall, delays, rollbacks; ours: causes named."""
    table: dict[tuple[str, str], dict] = {}
    for case in cases(load_curves("clean"), per_fingerprint):
        index = next(i for i, r in enumerate(case.records) if r.iteration == case.onset)
        for name in ALL:
            outcome = run(name, case.records, config, None)
            first = outcome.first_from(index)
            hit = first is not None and first - index <= WITHIN
            cell = table.setdefault(
                (case.fingerprint, name),
                {"n": 0, "hits": 0, "delays": [], "rollbacks": 0, "causes": 0, "false": 0},
            )
            cell["n"] += 1
            cell["hits"] += hit
            cell["false"] += len([i for i in outcome.flags if i < index])
            if hit:
                cell["delays"].append(first - index)
            if name == "this detector" and hit:
                mine = [e for i, e in outcome.events if i >= index]
                decided = next((e for e in mine if e.kind == "rollback"), mine[0])
                cell["rollbacks"] += decided.kind == "rollback"
                upto = [r for r in case.records if r.iteration <= decided.iteration + 1]
                cause = diagnose(decided.as_json(), upto).cause
                cell["causes"] += cause == EXPECTED_CAUSE[case.fingerprint]
    return table


def _delay(rows: list[dict], name: str) -> str:
    delays = [r["delay"] for r in rows if r["detector"] == name and r["delay"] is not None]
    return f"{statistics.mean(delays):.2f}" if delays else "-"


def print_incidents(rows: list[dict], title: str) -> None:
    print(f"\n### {title}\n")
    onsets = sorted({(r["curve"], r["onset"]) for r in rows})
    print("| incident (onset) | " + " | ".join(ALL) + " |")
    print("|---|" + "---:|" * len(ALL))
    for curve, onset in onsets:
        cells = []
        for name in ALL:
            row = next(
                r for r in rows if (r["curve"], r["onset"], r["detector"]) == (curve, onset, name)
            )
            cell = "miss" if row["delay"] is None else f"+{row['delay']}"
            if row["early"]:
                cell += f" ({row['early']} early)"
            if row["primer_flags"]:
                cell += f" [{row['primer_flags']} in primer]"
            cells.append(cell)
        print(f"| {curve} ({onset}) | " + " | ".join(cells) + " |")
    recall = [sum(r["delay"] is not None for r in rows if r["detector"] == n) for n in ALL]
    print(f"| **recall (of {len(onsets)})** | " + " | ".join(map(str, recall)) + " |")
    print("| mean delay (logged points) | " + " | ".join(_delay(rows, n) for n in ALL) + " |")


def print_clean(stats: dict[str, dict]) -> None:
    print("\n### clean runs (real), default configs\n")
    steps = stats["this detector"]["steps"]
    print(f"{steps:,} steps in {len(stats['this detector']['per_curve'])} runs\n")
    print("| detector | false flags /100k | false rollbacks /100k | flags per run | µs/step |")
    print("|---|---:|---:|---|---:|")
    for name in ALL:
        s = stats[name]
        per = ", ".join(str(f) for f, _ in s["per_curve"].values())
        rollbacks = s["rollbacks"] * 1e5 / s["steps"]
        print(
            f"| {name} | {s['flags'] * 1e5 / s['steps']:.1f} | {rollbacks:.1f} | {per} | "
            f"{s['seconds'] / s['steps'] * 1e6:.2f} |"
        )


def print_injected(table: dict[tuple[str, str], dict]) -> None:
    print("\n### injected fingerprints (SYNTHETIC, on the clean runs)\n")
    print("recall within 2 points (mean delay); ours also: rollbacks decided, causes named\n")
    print("| fingerprint | " + " | ".join(ALL) + " | ours: rollback | ours: cause right |")
    print("|---|" + "---:|" * (len(ALL) + 2))
    for fingerprint in FINGERPRINTS:
        cells = []
        for name in ALL:
            c = table[(fingerprint, name)]
            mean = f" ({statistics.mean(c['delays']):.1f})" if c["delays"] else ""
            cells.append(f"{c['hits']}/{c['n']}{mean}")
        ours = table[(fingerprint, "this detector")]
        cells += [f"{ours['rollbacks']}/{ours['hits']}", f"{ours['causes']}/{ours['hits']}"]
        print(f"| {fingerprint} | " + " | ".join(cells) + " |")
    before = [sum(table[(f, n)]["false"] for f in FINGERPRINTS) for n in ALL]
    print("| flags before the onsets | " + " | ".join(map(str, before)) + " | | |")


def sweep(base: SpikeConfig) -> None:
    """One knob at a time around the defaults: real recall, clean false flags/rollbacks,
    injected recall."""
    knobs: dict[str, list] = {
        "loss_rel": [0.05, 0.10, 0.15, 0.20],
        "mad_k": [3.0, 6.0, 9.0],
        "large_rel": [0.2, 0.3, 0.4, 0.5],
        "large_mad_k": [6.0, 9.0, 12.0, 18.0],
        "grad_factor": [1.5, 2.0, 3.0],
        "patience": [10, 20, 50, 100],
        "window": [50, 100, 200],
    }
    print("\n### one-at-a-time sweep (ours)\n")
    print(
        "| knob | value | real recall (as published) | real recall (primed) | clean flags | "
        "clean rollbacks | injected recall |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for knob, values in knobs.items():
        for value in values:
            config = replace(
                base, **{knob: value}, **({"warmup": value} if knob == "window" else {})
            )
            published = [r for r in incidents(config, False) if r["detector"] == "this detector"]
            primed = [r for r in incidents(config, True) if r["detector"] == "this detector"]
            stats = clean_ours(config)
            table = injected_ours(config)
            mark = " (default)" if getattr(base, knob) == value else ""
            print(
                f"| {knob} | {value}{mark} | {sum(r['delay'] is not None for r in published)}/"
                f"{len(published)} | {sum(r['delay'] is not None for r in primed)}/{len(primed)} | "
                f"{stats[0]} | {stats[1]} | {table[0]}/{table[1]} |"
            )


def clean_ours(config: SpikeConfig) -> tuple[int, int]:
    flags = rollbacks = 0
    for curve in load_curves("clean"):
        outcome = run("this detector", records_of(curve), config, None)
        flags, rollbacks = flags + len(outcome.flags), rollbacks + len(outcome.rollbacks)
    return flags, rollbacks


def injected_ours(config: SpikeConfig, per_fingerprint: int = 2) -> tuple[int, int]:
    hits = total = 0
    for case in cases(load_curves("clean"), per_fingerprint):
        index = next(i for i, r in enumerate(case.records) if r.iteration == case.onset)
        first = run("this detector", case.records, config, None).first_from(index)
        hits += first is not None and first - index <= WITHIN
        total += 1
    return hits, total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true", help="also sweep the defaults")
    parser.add_argument("--cases", type=int, default=4, help="injections per fingerprint and run")
    options = parser.parse_args(argv)
    config = SpikeConfig()
    print(f"this detector: {config}")
    print_incidents(incidents(config, False), "real incidents, as published (warm-up waived)")
    print_incidents(incidents(config, True), "real incidents, primed (semi-synthetic primer)")
    print_clean(clean(config))
    print_injected(injected(config, options.cases))
    if options.sweep:
        sweep(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
