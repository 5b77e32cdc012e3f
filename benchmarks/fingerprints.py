"""SYNTHETIC incidents: seed 000's five spike fingerprints injected into the real clean curves.

Everything this module produces is synthetic and labelled so in every table. The clean curves
(``benchmarks/curves``, real, as published) give the loss (and, for llm.c, the grad norm);
each injected case copies a stretch of one clean curve and adds ONE incident shaped by a
fingerprint of seed 000 chapter 2 (its table "fingerprint -> cause"):

- ``bad-batch``: one DP rank (of 8 or 64) reads garbage for 1-3 iterations: its local loss
  +1..6 nats (the DP average sees 1/8 or 1/64 of it), grad norm x1.2..8, then lasting damage;
- ``learning-rate``: the params norm grows 5x faster for 200 iterations and the grad norm
  creeps up x1.5..2 over the last 50, then the loss jumps +10..80 % with grad x5..10;
- ``bf16``: one step, no precursor: loss +10..60 %, grad x3..10, ``num_zeros`` x1.5..3, all
  back the next step, no damage;
- ``attention-logit``: the max attention logit climbs linearly to 110..160 over 300
  iterations, then the loss ramps up +20..100 % over 3 steps and stays up (decay over 600);
- ``optimizer-state``: the grad norm sits on a plateau at x0.4..0.6 for 300 iterations, then a
  normal-sized gradient is a x4..8 step: loss +10..80 %, params-norm kink.

"Lasting damage" (all but bf16) adds ``A·baseline·exp(-(t-t0)/300)`` with A = 0.3..0.8 to the
loss after the jump (the incident does not recover within a 50-iteration patience) and a
decaying grad excess.

Channels a clean curve does not have are synthesized, and are synthetic too: grad norm
(lognormal noise around a slowly decaying level) where the log has none; params norm (a
saturating rise); max attention logit (~30-40 with noise); num_zeros (~1000 with 2 % noise);
the worst DP rank's loss (the curve's loss + the max of 8 normal rank deviations of 2 %).
Seeds are fixed, so every run of the benchmark sees the same cases.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from megatron_ext.common.records.signals import SignalRecord

FINGERPRINTS = ("bad-batch", "learning-rate", "bf16", "attention-logit", "optimizer-state")
EXPECTED_CAUSE = {
    "bad-batch": "bad-data",
    "learning-rate": "learning-rate",
    "bf16": "bf16",
    "attention-logit": "attention-logit",
    "optimizer-state": "optimizer-state",
}
DP = 8
BEFORE, AFTER = 1500, 400  # iterations of the clean curve kept around each onset
DAMAGE_TAU = 300.0


@dataclass
class InjectedCase:
    name: str
    fingerprint: str
    records: list[SignalRecord]
    onset: int  # iteration of the injected onset


def _record(iteration: int, loss: float, grad: float | None) -> SignalRecord:
    return SignalRecord(
        iteration=iteration,
        attempt=1,
        job_id="synthetic",
        wall_time=0.0,
        consumed_samples=iteration,
        skipped_samples=0,
        lm_loss=loss,
        grad_norm=grad,
    )


def with_channels(curve, rng: random.Random) -> list[SignalRecord]:
    """The clean curve as signals records, with the synthetic channels filled in."""
    n = len(curve)
    span = max(n / 2, 1.0)
    out = []
    for k, (it, loss) in enumerate(zip(curve.iterations, curve.lm_loss)):
        real = curve.grad_norm[k]
        grad = (
            real
            if real is not None
            else 0.3 * (1 + 2 * math.exp(-k / 500)) * math.exp(0.12 * rng.gauss(0, 1))
        )
        record = _record(it, loss, grad)
        record.params_norm = 100 * (1 + 0.5 * (1 - math.exp(-k / span))) + rng.gauss(0, 0.01)
        record.max_attention_logit = 30 + 10 * (1 - math.exp(-k / span)) + rng.gauss(0, 1)
        record.num_zeros = 1000 * (1 + 0.02 * rng.gauss(0, 1))
        deviations = [rng.gauss(0, 0.02 * loss) for _ in range(DP)]
        rank = max(range(DP), key=lambda r: deviations[r])
        record.max_local_loss, record.max_loss_dp_rank = loss + deviations[rank], rank
        out.append(record)
    return out


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def _damage(
    records: list[SignalRecord],
    start: int,
    base: float,
    grad: float,
    amplitude: float,
    tau: float = DAMAGE_TAU,
) -> None:
    """Lasting damage from ``start``: loss +amplitude x baseline decaying over ``tau``."""
    for k in range(start, len(records)):
        decay = math.exp(-(k - start) / tau)
        r = records[k]
        r.lm_loss += amplitude * base * decay
        r.max_local_loss += amplitude * base * decay  # every rank is hurt alike
        r.grad_norm += grad * 4 * math.exp(-(k - start) / 30)


def inject(records: list[SignalRecord], fingerprint: str, t0: int, rng) -> None:
    """Add one incident at index ``t0`` of ``records`` (in place)."""
    base = _median([r.lm_loss for r in records[max(0, t0 - 100) : t0]])
    grad = _median([r.grad_norm for r in records[max(0, t0 - 100) : t0]])
    at = records[t0]
    if fingerprint == "bad-batch":
        ranks = rng.choice((DP, 8 * DP))  # the bad rank's share of the DP average
        rank, steps = rng.randrange(ranks), rng.choice((1, 2, 3))
        for k in range(t0, t0 + steps):
            delta = rng.uniform(1.0, 6.0)
            r = records[k]
            r.max_local_loss, r.max_loss_dp_rank = r.lm_loss + delta, rank
            r.lm_loss += delta / ranks
            r.grad_norm *= rng.uniform(1.2, 8.0)
        _damage(records, t0 + steps, base, grad, rng.uniform(0.3, 0.8))
    elif fingerprint == "learning-rate":
        rate = (records[t0].params_norm - records[t0 - 400].params_norm) / 400
        for k in range(t0 - 200, len(records)):
            records[k].params_norm += 4 * rate * (k - (t0 - 200))
        ramp = rng.uniform(1.5, 2.0)
        for k in range(t0 - 50, t0):
            records[k].grad_norm *= 1 + (ramp - 1) * (k - (t0 - 50)) / 50
        _jump(at, base, rng.uniform(0.1, 0.8), grad * rng.uniform(5, 10))
        _damage(records, t0 + 1, base, grad, rng.uniform(0.3, 0.8))
    elif fingerprint == "bf16":
        _jump(at, base, rng.uniform(0.1, 0.6), grad * rng.uniform(3, 10))
        at.num_zeros *= rng.uniform(1.5, 3.0)
    elif fingerprint == "attention-logit":
        level, peak = records[t0 - 300].max_attention_logit, rng.uniform(110, 160)
        for k in range(t0 - 300, len(records)):
            share = min(1.0, (k - (t0 - 300)) / 300)
            records[k].max_attention_logit = level + (peak - level) * share + rng.gauss(0, 1)
        rise = rng.uniform(0.2, 1.0)
        for step in range(3):
            r = records[t0 + step]
            _jump(r, base, rise * (step + 1) / 3, r.grad_norm * (1 + (step + 1) * 1.5))
        _damage(records, t0 + 3, base, grad, rise, tau=2 * DAMAGE_TAU)
    elif fingerprint == "optimizer-state":
        low = rng.uniform(0.4, 0.6)
        for k in range(t0 - 300, t0):
            records[k].grad_norm *= low
        rate = (records[t0].params_norm - records[t0 - 400].params_norm) / 400
        for k in range(t0, len(records)):
            records[k].params_norm += 2 * rate * min(k - t0, 50)
        _jump(at, base, rng.uniform(0.1, 0.8), grad * rng.uniform(4, 8))
        _damage(records, t0 + 1, base, grad, rng.uniform(0.3, 0.8))
    else:
        raise ValueError(f"unknown fingerprint {fingerprint!r}")


def _jump(record: SignalRecord, base: float, rise: float, grad: float) -> None:
    """The loss of every rank up by ``rise`` x baseline; the grad norm set to ``grad``."""
    record.lm_loss += rise * base
    record.max_local_loss += rise * base
    record.grad_norm = grad


def cases(curves, per_fingerprint: int = 4, seed: int = 0) -> list[InjectedCase]:
    """``per_fingerprint`` onsets per fingerprint and clean curve, spread over the curve."""
    out = []
    for curve in curves:
        rng = random.Random(f"{seed}:{curve.name}")
        base = with_channels(curve, rng)
        n = len(base)
        for f_index, fingerprint in enumerate(FINGERPRINTS):
            for j in range(per_fingerprint):
                # Onsets from 25 % to 90 % of the run, fingerprints interleaved.
                share = 0.25 + 0.65 * (j * len(FINGERPRINTS) + f_index) / (
                    per_fingerprint * len(FINGERPRINTS)
                )
                t0 = int(share * n)
                lo, hi = max(0, t0 - BEFORE), min(n, t0 + AFTER)
                records = [replace(r) for r in base[lo:hi]]
                inject(records, fingerprint, t0 - lo, rng)
                out.append(
                    InjectedCase(
                        name=f"{curve.name}@{base[t0].iteration}:{fingerprint}",
                        fingerprint=fingerprint,
                        records=records,
                        onset=base[t0].iteration,
                    )
                )
    return out
