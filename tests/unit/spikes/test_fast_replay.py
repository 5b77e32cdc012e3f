"""The fast replay gives exactly the events of ``replay`` (the detector observing every
record), on logs with every kind of trouble, read in blocks of every size; and on a long
healthy log it observes only a few records."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

from megatron_ext.common.records.signals import (
    COLUMNS,
    SignalRecord,
    SignalsWriter,
    parse_block,
    read_signals,
)
from megatron_ext.common.records.spike_config import SpikeConfig
from megatron_ext.spikes.detector import SpikeDetector, replay
from megatron_ext.spikes.fast_replay import FastReplay, state_of

CONFIGS = [
    SpikeConfig(window=20, warmup=20, patience=5, context=5),
    SpikeConfig(window=15, warmup=8, patience=3, context=30, grad_factor=1.5, mad_k=3.0),
    SpikeConfig(window=40, warmup=60, patience=8, per_source=False),
]


def _log(directory: Path, length: int, seed: int) -> Path:
    """A falling loss with noise and, at random places, every kind of trouble the detector
    reads: large and moderate spikes (with and without a grad-norm rise), one rank's bad
    batch, a level shift, skip streaks, loss-scale drops, withheld updates, NaN/Inf, stretches
    without a grad norm or a worst rank, and a blend that starts late."""
    rng = random.Random(seed)
    trouble = {i: rng.choice(range(12)) for i in rng.sample(range(50, length), length // 60)}
    writer = SignalsWriter(directory)
    scale, shift = 65536.0, 1.0
    for i in range(1, length + 1):
        kind = trouble.get(i)
        loss = (2.0 + 3.0 / (1 + i / 300) + rng.gauss(0, 0.02)) * shift
        grad, worst = 1.0 + rng.gauss(0, 0.05), loss + abs(rng.gauss(0.05, 0.01))
        skipped = withheld = False
        if kind == 0:
            loss *= 2.0  # large
        elif kind == 1:
            loss, grad = loss * 1.2, grad * 4  # moderate, corroborated
        elif kind == 2:
            loss *= 1.2  # moderate alone
        elif kind == 3:
            worst = loss * 3  # one rank's bad batch
        elif kind == 4:
            shift *= 1.15  # a level shift
        elif kind == 5:
            skipped = True
        elif kind == 6:
            scale /= 2
        elif kind == 7:
            withheld = skipped = True
        elif kind == 8:
            loss = rng.choice([math.nan, math.inf])
        elif kind == 9:
            grad = math.inf
        for j in range(1, 8) if kind == 10 else ():
            trouble.setdefault(i + j, 11)  # a skip streak
        skipped = skipped or kind == 11
        blend = i > 0.8 * length
        writer.write(
            SignalRecord(
                iteration=i,
                attempt=0,
                job_id="j",
                wall_time=float(i),
                consumed_samples=8 * i,
                skipped_samples=0,
                lm_loss=loss,
                grad_norm=None if 0.3 * length < i < 0.35 * length else grad,
                max_local_loss=None if 0.5 * length < i < 0.52 * length else worst,
                max_loss_dp_rank=i % 4,
                lm_loss_by_dataset=(
                    {"web": loss * 0.9, "code": loss * 1.1} if blend else {"web": loss}
                ),
                tokens_by_dataset={"web": 300, "code": 212} if blend else {"web": 512},
                loss_scale=scale,
                skipped_iter=skipped,
                update_skipped=withheld,
                lr=1e-4 * i,
                log_z=None if i % 97 else 3.5,
            )
        )
    return writer.path


def _fast(path: Path, config: SpikeConfig, seed: int) -> tuple[list, FastReplay]:
    rng = random.Random(seed)
    lines = path.read_bytes().splitlines(keepends=True)
    fast, events, at = FastReplay(SpikeDetector(config)), [], 0
    while at < len(lines):
        size = rng.choice([1, 2, 7, 50, 333, 4000])
        block = parse_block(b"".join(lines[at : at + size]), 0, COLUMNS, sources=True)
        events += fast.feed(block, np.arange(len(block)))
        at += size
    return events, fast


def _text(events: list) -> list[str]:
    return [json.dumps(e.as_json(), sort_keys=True) for e in events]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_fast_replay_gives_every_event_of_the_full_replay(
    tmp_path: Path, config: SpikeConfig, seed: int
) -> None:
    path = _log(tmp_path, 3000, seed)
    expected = replay(read_signals(path), config)
    assert len(expected) > 20 and {"spike", "divergence", "rollback"} <= {e.kind for e in expected}
    events, fast = _fast(path, config, seed)
    assert _text(events) == _text(expected)
    assert fast.verified and fast.observed < 3000


def test_a_healthy_default_run_is_observed_only_where_the_arrays_cannot_decide(
    tmp_path: Path,
) -> None:
    config = SpikeConfig()
    writer = SignalsWriter(tmp_path)
    rng = random.Random(3)
    for i in range(1, 20001):
        loss = 2.0 + 3.0 / (1 + i / 1000) + rng.gauss(0, 0.02) + (3.0 if i == 15000 else 0.0)
        writer.write(
            SignalRecord(
                iteration=i,
                attempt=0,
                job_id="local",
                wall_time=float(i),
                consumed_samples=8 * i,
                skipped_samples=0,
                lm_loss=loss,
                max_local_loss=loss,
                max_loss_dp_rank=0,
                grad_norm=1.0 + rng.gauss(0, 0.05),
                lm_loss_by_dataset={"tiny_text_document": loss},
                tokens_by_dataset={"tiny_text_document": 512},
                lr=3e-4,
                loss_scale=1.0,
            )
        )
    events, fast = _fast(writer.path, config, 0)
    assert _text(events) == _text(replay(read_signals(writer.path), config))
    assert [e.kind for e in events] == ["spike", "recovered"]
    # The warm-up and the check (~300), the spike and the resync after it (~200).
    assert fast.observed < 1000, fast.observed


def test_a_detector_whose_quiet_path_does_more_is_replayed_live(tmp_path: Path) -> None:
    """The first skipping is checked against a copy: a quiet path this module does not know
    (here: one that counts quiet steps) keeps the replay live, and exact."""

    class Counting(SpikeDetector):
        def observe(self, record: SignalRecord) -> list:
            self.quiet_steps = getattr(self, "quiet_steps", 0) + 1
            return super().observe(record)

    path = _log(tmp_path, 1500, 4)
    config = CONFIGS[0]
    expected = replay(read_signals(path), config)
    block = parse_block(path.read_bytes(), 0, COLUMNS, sources=True)
    fast = FastReplay(Counting(config))
    assert _text(fast.feed(block, np.arange(len(block)))) == _text(expected)
    assert fast.verified is False and fast.observed == 1500
    assert state_of(1.5) == "1.5" and state_of(math.nan) == state_of(math.nan)
