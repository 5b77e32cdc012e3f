"""The early warning on the public clean curves of ``benchmarks/curves`` (SOURCES.md): how
many warnings the precursor monitor raises on real runs that never diverged, at the default
windows and at the drills' (a warning there is a false one).

    PYTHONPATH=. .venv/bin/python benchmarks/early_warning_curves.py

Only curves that carry the grad norm can warn (the attention logit and log Z are not in any
public log here); the others are listed with their point counts so the reader sees why.
"""

from __future__ import annotations

from benchmarks.curves import load_curves
from benchmarks.detector import records_of
from megatron_ext.common.records.spike_config import SpikeConfig
from megatron_ext.spikes.precursors import WarnConfig, replay

WINDOWS = (20, 50, 100)


def main() -> None:
    windows = "".join(f" window {w} |" for w in WINDOWS)
    print(f"| curve | points | with grad norm |{windows}")
    print("|---|---:|---:|" + "---:|" * len(WINDOWS))
    for curve in load_curves("clean"):
        records = records_of(curve)
        graded = sum(r.grad_norm is not None for r in records)
        counts = [
            len(replay(records, WarnConfig.following(SpikeConfig(window=w, warmup=w))))
            for w in WINDOWS
        ]
        cells = "".join(f" {count} |" for count in counts)
        print(f"| {curve.name} | {len(records)} | {graded} |{cells}")


if __name__ == "__main__":
    main()
