"""The early warning (``megatron_ext.spikes.precursors``) judged on the organic runs of
``benchmarks/instability.py``: its lead time before the loss blows up, and its false warnings
on the runs that never blow up. Also the spike detector's verdicts on the same runs.

    .venv/bin/python benchmarks/early_warning.py --results /tmp/instability_out/results

Reads every ``ARM@RATE.json`` the sweep wrote (per-iteration lm loss, grad norm, log Z, max
attention logit, skip flags), replays the precursor monitor and the spike detector over them
and prints, per run: where the loss blew up (the first iteration after ``--settle`` whose loss
is non-finite or above the lowest loss so far by ``--margin`` nats for ``--stretch`` (10)
iterations in a row, the sweep's definition), the first warning per
signal, the lead time (blow-up minus the first warning) and whether the detector flagged or
rolled back. Two monitor configurations side by side, each with the detector whose
windows it follows (``WarnConfig.following``), warnings kept as training keeps them (not
while an incident is in progress): the defaults (``--spike-window 100 --spike-warmup 100``, for real
runs of thousands of steps) and ``--spike-window 20 --spike-warmup 20``, the scale of the drills
(these runs are a few hundred steps; their learning-rate warm-up is a fifth of the run). A run
*failed* when it blew up or its final loss is ``--margin`` above the best final loss of the
sweep's lowest rate; a warning counts as *false* on a run that did not fail, and as *late*
when it comes after the blow-up.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_ext.common.records.signals import SignalRecord  # noqa: E402
from megatron_ext.common.records.spike_config import SpikeConfig  # noqa: E402
from megatron_ext.spikes.detector import SpikeDetector, SpikeEvent  # noqa: E402
from megatron_ext.spikes.precursors import (  # noqa: E402
    PrecursorMonitor,
    PrecursorWarning,
    WarnConfig,
)


def records(run: dict[str, Any]) -> list[SignalRecord]:
    """The run's signals as the monitor reads them in training."""
    skipped = set(run.get("skipped_iter") or [])
    withheld = set(run.get("update_skipped") or [])
    out = []
    for k, iteration in enumerate(run["iteration"]):
        loss = run["lm_loss"][k]
        out.append(
            SignalRecord(
                iteration=iteration,
                attempt=1,
                job_id="bench",
                wall_time=float(iteration),
                consumed_samples=iteration,
                skipped_samples=0,
                lm_loss=math.nan if loss is None else loss,
                grad_norm=run["grad_norm"][k],
                log_z=run["log_z"][k],
                max_attention_logit=run["max_attention_logit"][k],
                skipped_iter=iteration in skipped or iteration in withheld,
                update_skipped=iteration in withheld,
            )
        )
    return out


def blow_up(run: dict[str, Any], settle: int, margin: float, stretch: int) -> int | None:
    """The first iteration after ``settle`` of a stretch of ``stretch`` iterations whose loss is
    non-finite or ``margin`` above the lowest loss before the stretch (the sweep's "blow-up of
    10+ iterations"; a shorter bump is a spike). A run that ended early blew up at its end."""
    lowest, start = math.inf, None
    for k, (iteration, loss) in enumerate(zip(run["iteration"], run["lm_loss"])):
        bad = loss is None or not math.isfinite(loss) or loss > lowest + margin
        if bad and iteration > settle:
            start = iteration if start is None else start
            if k + 1 == len(run["iteration"]) or iteration - start + 1 >= stretch:
                return start
            continue
        start = None
        lowest = min(lowest, loss)
    if run.get("returncode", 0) != 0:
        return run["iteration"][-1] + 1 if run["iteration"] else 1
    return None


def warnings_as_trained(
    signals: list[SignalRecord], detector: SpikeConfig
) -> tuple[list[PrecursorWarning], list[SpikeEvent]]:
    """The warnings and detector events training would log: as ``SpikeFeature`` does, a
    warning is kept only on a step where the detector is healthy and emits nothing (a
    precursor precedes an incident); after a rollback decision the replay goes on."""
    spikes, monitor = SpikeDetector(detector), PrecursorMonitor(WarnConfig.following(detector))
    warnings, events = [], []
    for record in signals:
        step = spikes.observe(record)
        raised = monitor.observe(record)
        if not step and spikes.state == "healthy":
            warnings += raised
        events += step
        if spikes.state == "rollback":
            spikes.resume()
    return warnings, events


def judge(
    run: dict[str, Any], detector: SpikeConfig, onset: int | None, failed: bool
) -> dict[str, Any]:
    warnings, events = warnings_as_trained(records(run), detector)
    first = min((w.iteration for w in warnings), default=None)
    return {
        "warnings": [(w.iteration, w.signal) for w in warnings],
        "first": first,
        "lead": None if onset is None or first is None or first > onset else onset - first,
        "false": not failed and bool(warnings),
        "late": onset is not None and first is not None and first > onset,
        "events": sorted({e.kind for e in events} & {"spike", "divergence", "rollback"}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=Path("/tmp/instability_out/results"))
    parser.add_argument("--settle", type=int, default=20)
    parser.add_argument("--margin", type=float, default=1.0)
    parser.add_argument("--stretch", type=int, default=10)
    args = parser.parse_args()
    runs = [json.loads(p.read_text()) for p in sorted(args.results.glob("*@*.json"))]
    runs.sort(key=lambda r: (r["arm"], r["rate"]))
    configs = {
        "window 100 (default)": SpikeConfig(),
        "window 20": SpikeConfig(window=20, warmup=20, patience=10),  # the drills' scale
    }
    lowest = min((r["rate"] for r in runs), default=0)
    best = min((r["final_loss"] for r in runs if r["rate"] == lowest), default=math.inf)
    heads = " | ".join(f"{n}: first warning (signal), lead" for n in configs)
    print(f"| arm | lr | outcome | {heads} | detector at window 100 / 20 |")
    print("|---|---:|---|" + "---|" * len(configs) + "---|")
    keys = ("lead", "false", "late", "missed", "healthy", "warned")
    totals: dict[str, dict[str, Any]] = {
        n: {k: [] if k == "lead" else 0 for k in keys} for n in configs
    }
    for run in runs:
        onset = blow_up(run, args.settle, args.margin, args.stretch)
        final = run.get("final_loss")
        failed = onset is not None or final is None or final > best + args.margin
        cells, verdicts = [], []
        for name, config in configs.items():
            j = judge(run, config, onset, failed)
            t = totals[name]
            t["healthy"] += not failed
            t["false"] += j["false"]
            t["late"] += j["late"]
            t["warned"] += failed and j["first"] is not None
            t["missed"] += failed and j["first"] is None
            if j["lead"] is not None:
                t["lead"].append(j["lead"])
            verdicts.append(", ".join(j["events"]) or "-")
            signal = next((s for i, s in j["warnings"] if i == j["first"]), "")
            cells.append("none" if j["first"] is None else f"{j['first']} ({signal}), {j['lead']}")
        shown = "-" if final is None else f"{final:.3f}"
        outcome = f"blew up at {onset}" if onset else ("failed" if failed else "healthy")
        row = f"| {run['arm']} | {run['rate']:g} | {outcome} (final {shown}) | "
        print(row + " | ".join(cells) + f" | {' / '.join(verdicts)} |")
    print()
    for name, t in totals.items():
        leads = sorted(t["lead"])
        median = leads[len(leads) // 2] if leads else None
        print(
            f"{name}: warned on {t['warned']} failed run(s), missed {t['missed']}; before a "
            f"blow-up on {len(leads)} (median lead {median} iterations, {leads}), late on "
            f"{t['late']}; false warnings on {t['false']} of {t['healthy']} healthy run(s)"
        )


if __name__ == "__main__":
    main()
