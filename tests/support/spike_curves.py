"""Synthetic signals for detector and planner unit tests (real curves: benchmarks/curves)."""

from __future__ import annotations

import random

from megatron_ext.common.records.signals import SignalRecord
from megatron_ext.spikes.detector import SpikeConfig, SpikeDetector

CONFIG = SpikeConfig(window=20, warmup=20, patience=5, grad_factor=3.0)


def records(
    n: int, spikes: dict[int, tuple[float, float]] | None = None, attempt: int = 1, seed: int = 0
) -> list[SignalRecord]:
    rng = random.Random(seed)
    out = []
    for i in range(1, n + 1):
        loss, grad = (spikes or {}).get(i, (3.0 + rng.gauss(0, 0.02), 1.0 + rng.gauss(0, 0.05)))
        out.append(
            SignalRecord(
                iteration=i,
                attempt=attempt,
                job_id="j",
                wall_time=0.0,
                consumed_samples=8 * i,
                skipped_samples=0,
                lm_loss=loss,
                grad_norm=grad,
                max_loss_dp_rank=i % 2,
                max_local_loss=loss,
            )
        )
    return out


def events(records: list[SignalRecord], config: SpikeConfig = CONFIG) -> list:
    detector = SpikeDetector(config)
    return [e for r in records for e in detector.observe(r)]
