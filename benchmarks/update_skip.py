"""The adaptive update skip's gate (``megatron_ext.spikes.update_skip``) on real grad-norm curves:
how many healthy updates it would withhold, and in which streaks, at several thresholds.

    .venv/bin/python benchmarks/update_skip.py

Replays the gate over the five real clean runs of ``benchmarks/curves`` (74,713 steps: llm.c
GPT-2 124M, modded-nanogpt 124M AdamW / Muon / scale-shortcuts, the 1.5B scale-up; sources in
``benchmarks/curves/SOURCES.md``) and over the real incident excerpts, as training would run
it: the threshold from earlier steps only, a withheld step kept out of the baseline. On a clean
run every withheld update is a false one, and a streak of ``--spike-skip-streak`` (5) of them
would start an incident. On an incident, the onset's update should be withheld. Offline: the
replay cannot show what the withheld updates would have changed downstream.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.curves import load_curve, load_curves  # noqa: E402
from benchmarks.detector import primer  # noqa: E402
from megatron_ext.spikes.update_skip import GateConfig, UpdateGate  # noqa: E402

SETTINGS = ((2.0, 6.0), (3.0, 6.0), (2.0, 12.0), (3.0, 12.0))
STREAK = 5


def replay(norms: list[float | None], config: GateConfig) -> tuple[list[int], int]:
    """Indices of withheld updates and the longest streak of them."""
    gate, withheld, streak, longest = UpdateGate(config), [], 0, 0
    for index, norm in enumerate(norms):
        limit = gate.threshold()
        skip = norm is not None and norm > limit
        gate.learn(norm, skipped=skip)
        streak = streak + 1 if skip else 0
        longest = max(longest, streak)
        if skip:
            withheld.append(index)
    return withheld, longest


def main() -> None:
    clean = load_curves("clean")
    steps = sum(len(c.grad_norm) for c in clean)
    print(f"clean runs: {len(clean)}, {steps:,} steps (window 100, warm-up 100)\n")
    print(
        "| factor | MAD k | withheld /100k | per run | longest streak | runs with a streak >= 5 |"
    )
    print("|---:|---:|---:|---|---:|---:|")
    for factor, k in SETTINGS:
        config = GateConfig(factor=factor, mad_k=k)
        counts, streaks = [], []
        for curve in clean:
            withheld, longest = replay(list(curve.grad_norm), config)
            counts.append(len(withheld))
            streaks.append(longest)
        rate = 1e5 * sum(counts) / steps
        flagged = sum(s >= STREAK for s in streaks)
        print(
            f"| {factor:g} | {k:g} | {rate:.1f} | {', '.join(map(str, counts))} | "
            f"{max(streaks)} | {flagged} |"
        )
    print("\nreal incidents, primed (200 points of llm.c's relative noise before each excerpt,")
    print("the detector benchmark's protocol), default gate:\n")
    print("| incident (onset) | onset grad norm / its median | withheld at the onset | withheld |")
    print("|---|---:|---|---:|")
    reference = load_curve("llmc_gpt2_124m_main")
    for curve in load_curves("incident"):
        head = primer(curve, reference)
        norms = [r.grad_norm for r in head] + list(curve.grad_norm)
        withheld, _ = replay(norms, GateConfig())
        at = {curve.iterations[i - len(head)] for i in withheld if i >= len(head)}
        onset = curve.iterations.index(curve.onsets[0]) + len(head)
        before = [n for n in norms[:onset] if n is not None]
        ratio = "-"
        if norms[onset] is not None and before:
            ratio = f"{norms[onset] / sorted(before)[len(before) // 2]:.2f}"
        hit = "yes" if any(o in at for o in curve.onsets) else "no"
        print(f"| {curve.name} ({curve.onsets[0]}) | {ratio} | {hit} | {len(at)} |")


if __name__ == "__main__":
    main()
