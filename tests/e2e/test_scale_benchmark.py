"""``benchmarks/scale.py`` at two tiny scales (1/10,000 and 1/1,000 of a real run): every
operation runs, and what must not grow with the data does not.

No absolute times. What is asserted is relative, within one run: the overlay's start-up peak
memory against plain Megatron's on the same data and args (issue #24's <= 5 % target), and,
between two scales 10x apart, the peak RSS and the pages touched (minor faults) of the
operations that must stay flat: the overlay's start-up data checks (a fingerprint of 16
sampled blocks and two index reads per prefix, whatever the corpus size) and a one-rank
``lookup --iteration``. Operations other work is making flat (plot, planner, sample-log
checks) are measured and printed, not bounded here; their own tests count what they read.
The two start-up launches (plain and overlay) run at the larger scale only: their comparison
is within one scale. So do the operations measured but not bounded: the smaller scale runs
the cache build (the lookup reads its caches) and the two flat operations.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import scale  # noqa: E402

SCALES = (0.0001, 0.001)
FLAT = ("data checks", "lookup --iteration --dp-rank")


def test_scale_benchmark_runs_every_operation_and_flat_ones_stay_flat(tmp_path) -> None:
    small_scale, large_scale = SCALES
    by_scale = scale.measure_scales(tmp_path, [small_scale], start_ups=False, only=FLAT)
    by_scale |= scale.measure_scales(tmp_path, [large_scale])
    failed = [(s, m.operation) for s, ms in by_scale.items() for m in ms if m.returncode]
    assert not failed, f"operations failed (logs under {tmp_path}/scale-*/logs): {failed}"
    small, large = ({m.operation: m for m in by_scale[s]} for s in SCALES)
    assert len(large) == 10 and list(small) == ["megatron cache build", *FLAT], small
    plain, overlay = large["start-up plain"], large["start-up overlay"]
    assert overlay.peak_rss <= 1.05 * plain.peak_rss, (
        f"the overlay's start-up peak RSS {overlay.peak_rss >> 20} MiB exceeds plain "
        f"Megatron's {plain.peak_rss >> 20} MiB by more than 5 %"
    )
    for name in FLAT:
        rss = large[name].peak_rss / small[name].peak_rss
        faults = large[name].minor_faults / small[name].minor_faults
        assert rss < 1.5 and faults < 1.5, (
            f"{name} grew with the data: RSS x{rss:.2f}, faults x{faults:.2f}"
        )
    rows = scale.table(by_scale).splitlines()[2:]
    assert len(rows) == len(large), rows
    larger_only = [o for o in large if o not in small]
    assert [r.split(" | ")[0].strip("| ") for r in rows if r.count(" - |") == 2] == larger_only
