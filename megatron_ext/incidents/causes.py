"""Which of seed 000's five causes an incident most likely had (no Megatron imports).

Seed 000's decision tree (chapter 2 §7) over the signals before and at the onset, most
specific and earliest-visible fingerprint first; each answer is ``yes``, ``no`` or ``unknown``
(a signal was not recorded), the first ``yes`` names the cause, and the evidence and the
missing signals go to the report.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from megatron_ext.common.records.signals import SignalRecord
from megatron_ext.common.records.spike_config import ATTENTION_LOGIT_LIMIT
from megatron_ext.spikes.precursors import rank_trend
from megatron_ext.telemetry.layers import first_rising_layer

Answer = Literal["yes", "no", "unknown"]

LOOKBACK = 1000  # iterations before the onset the precursor questions read ("normal")
RECENT = 100  # the "just before the onset" stretch compared with the rest of the lookback
RISE = 200  # the stretch whose max attention logit must rise steadily
LOGIT_TREND = 0.8  # rank correlation of the max logit with time that is "rising steadily"
PARAMS_ACCEL = 2.0  # params-norm growth rate before the onset / the rate before that
GRAD_RISE = 1.3  # grad-norm median of the last RECENT/4 iterations / earlier median: "rising"
SINGLE_RANK = 0.8  # worst rank's rise over the average / the average's rise: one rank
ONE_RANK_FLOOR = 0.1  # ... and that extra rise is at least 10 % of the loss
ONE_SOURCE = 0.2  # a member's loss this far above its own median before the onset: its jump
PLATEAU = 0.7  # grad-norm median just before the onset / earlier median: "below normal"
ZEROS_K = 6.0  # robust sigmas of num_zeros that make it anomalous
GRAD_BACK = 2.0  # grad norm under this many times its baseline the next step: "back"
STRAGGLER_BEFORE = 10  # iterations before the onset in which a named straggler coincides

CAUSES = {
    "attention-logit": (
        "attention-logit growth",
        "enable QK-LayerNorm / qk_clip; roll back to before the logit rise started",
    ),
    "learning-rate": (
        "learning rate",
        "lower the LR / lengthen warmup / check the schedule's "
        "turning points; roll back to before the growth started",
    ),
    "bad-data": (
        "single-rank bad data",
        "look up the culprit rank's batch (top documents below), roll back + skip, add the "
        "documents to the data filter",
    ),
    "bad-source": (
        "bad data in one source",
        "look up the batch's documents of the culprit source (top documents below), roll back "
        "+ skip, fix or filter that source",
    ),
    "straggler": (
        "a straggling rank at the onset (a slow or failing node)",
        "check the named node (GPU health, ECC/Xid errors, thermals, dmesg), drain it from the "
        "allocation, roll back + relaunch without it",
    ),
    "optimizer-state": (
        "optimizer-state timing",
        "roll back ~100 iterations and skip 200-500 batches so the optimizer state and the "
        "data fall out of phase",
    ),
    "bf16": (
        "bf16 sporadic",
        "usually nothing; check the precision checklist (fp32 master params, fp32 grad "
        "accumulation, fp32 softmax and logits)",
    ),
    "non-finite": (
        "non-finite loss or grad norm (NaN/Inf), no precursor",
        "roll back + skip (the planner's window); the same failure again after the rollback "
        "rolls back further and widens the skip; a NaN a few iterations after every load of "
        "one checkpoint means that checkpoint is damaged (Megatron-LM #5281)",
    ),
    "transient": (
        "transient spike, no fingerprint matched",
        "wait within the patience window; roll back + skip if it does not recover",
    ),
}


@dataclass
class Question:
    """One step of the tree, with what it read."""

    name: str
    question: str
    answer: Answer
    evidence: str
    missing: list[str] = field(default_factory=list)


@dataclass
class Diagnosis:
    """The tree's walk over one incident."""

    diverged: bool
    cause: str  # a key of CAUSES
    label: str
    action: str
    culprit_dp_rank: int | None
    steps: list[Question]
    missing: list[str]  # every signal a question needed and the run did not record
    culprit_source: str | None = None  # the blend member whose own loss jumped
    first_layer: str | None = None  # --log-layer-norms: whose grad norm rose first, and when

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def _finite(*values: float | None) -> bool:
    return all(v is not None and math.isfinite(v) for v in values)


def _values(records: list[SignalRecord], name: str) -> list[float]:
    return [v for r in records if (v := getattr(r, name)) is not None and math.isfinite(v)]


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def _divergence(incident: dict[str, Any], after: list[SignalRecord]) -> Question:
    q = "non-finite loss or grad, or no recovery?"
    bad = [r.iteration for r in after if not _finite(r.lm_loss or 0.0, r.grad_norm or 0.0)]
    if bad:
        return Question("divergence", q, "yes", f"non-finite loss/grad norm at iteration {bad[0]}")
    if incident.get("kind") in ("rollback", "divergence"):
        why = f"not recovered: {incident.get('classification')}"
        return Question("divergence", q, "yes", why)
    return Question("divergence", q, "no", "finite, and the incident recovered")


def _logit(before: list[SignalRecord]) -> Question:
    q = "max attention logit rising steadily before the onset, past ~100?"
    logits = _values(before[-RISE:], "max_attention_logit")
    if len(logits) < 3:
        missing = ["max_attention_logit (--log-max-attention-logit)"]
        return Question(
            "attention-logit", q, "unknown", "max attention logit not recorded", missing
        )
    trend = rank_trend(logits)
    peak = max(logits)
    answer: Answer = "yes" if trend >= LOGIT_TREND and peak >= ATTENTION_LOGIT_LIMIT else "no"
    why = (
        f"{logits[0]:.4g} -> {logits[-1]:.4g} over the last {len(logits)} "
        f"iterations, rank correlation with time {trend:.2f} (steady if >= "
        f"{LOGIT_TREND:g}), peak {peak:.4g} (limit {ATTENTION_LOGIT_LIMIT:g})"
    )
    return Question("attention-logit", q, answer, why)


def _rate(values: list[float]) -> float:
    return (values[-1] - values[0]) / max(len(values) - 1, 1)


def _history(name: str, q: str, before: list[SignalRecord], signals: list[str]) -> Question | None:
    """Why a question comparing the last RECENT iterations of ``signals`` with the ones before
    is ``unknown`` (a signal not recorded, or too few iterations); None: answerable."""
    missing = [f"{s} (signals: --signals-dir)" for s in signals if not _values(before, s)]
    count = min(len(_values(before, s)) for s in signals)
    if missing or count >= 2 * RECENT:
        return Question(name, q, "unknown", "not recorded", missing) if missing else None
    why = (
        f"only {count} iteration(s) before the onset, {2 * RECENT} needed (last {RECENT} vs before)"
    )
    return Question(name, q, "unknown", why)


def _learning_rate(before: list[SignalRecord]) -> Question:
    q = "params norm growing faster before the onset, grad norm already rising?"
    short = _history("learning-rate", q, before, ["params_norm", "grad_norm"])
    if short is not None:
        return short
    params = _values(before, "params_norm")
    grads = _values(before, "grad_norm")
    recent, earlier = _rate(params[-RECENT:]), _rate(params[:-RECENT])
    accel = recent / earlier if earlier > 0 else (math.inf if recent > 0 else 0.0)
    grad_ratio = statistics.median(grads[-RECENT // 4 :]) / statistics.median(grads[:-RECENT])
    answer: Answer = "yes" if accel >= PARAMS_ACCEL and grad_ratio >= GRAD_RISE else "no"
    why = (
        f"params-norm growth {recent:.3g}/iter vs {earlier:.3g}/iter before "
        f"(x{accel:.3g}, limit x{PARAMS_ACCEL:g}); grad norm x{grad_ratio:.3g} "
        f"of its earlier median (limit x{GRAD_RISE:g})"
    )
    return Question("learning-rate", q, answer, why)


def _excess(records: list[SignalRecord]) -> list[tuple[float, SignalRecord]]:
    return [
        (r.max_local_loss - r.lm_loss, r) for r in records if _finite(r.max_local_loss, r.lm_loss)
    ]  # type: ignore[operator]


def _bad_data(
    before: list[SignalRecord], at: list[SignalRecord], reproduced: bool
) -> tuple[Question, int | None]:
    q = "worst DP rank's loss far above the DP average at the onset?"
    pairs, onset = _excess(before), _excess(at)
    if not pairs or not onset:
        missing = ["max_local_loss (telemetry --signals-dir)"]
        return Question(
            "bad-data", q, "unknown", "the worst DP rank's loss was not recorded", missing
        ), None
    base_excess = statistics.median(e for e, _ in pairs)
    base_mean = statistics.median(r.lm_loss for _, r in pairs)
    excess, peak = max(onset, key=lambda pair: pair[0])
    excess_jump, mean_jump = excess - base_excess, peak.lm_loss - base_mean
    single = excess_jump >= SINGLE_RANK * max(mean_jump, 0.0) and excess_jump >= (
        ONE_RANK_FLOOR * abs(base_mean)
    )
    confirm = (
        "reproduced at the same onset after a rollback"
        if reproduced
        else "not confirmed yet (--policy confirm replays the same data once)"
    )
    evidence = (
        f"iteration {peak.iteration}: DP rank {peak.max_loss_dp_rank} at "
        f"{peak.max_local_loss:.4g}, {excess:.3g} over the average {peak.lm_loss:.4g} "
        f"(usually {base_excess:.3g}): the worst rank rose {excess_jump:+.3g} more than "
        f"the average, the average {mean_jump:+.3g}; {confirm}"
    )
    return Question("bad-data", q, "yes" if single else "no", evidence), (
        peak.max_loss_dp_rank if single else None
    )


def _bad_source(
    named: str | None, before: list[SignalRecord], at: list[SignalRecord]
) -> tuple[str, str] | None:
    """(culprit member, evidence) when one member's own loss rose ``ONE_SOURCE`` over its
    median, and over twice any other member's rise."""
    rises: dict[str, tuple[float, float, SignalRecord]] = {}
    for name in {n for r in at for n in r.lm_loss_by_dataset}:
        base = [r.lm_loss_by_dataset[name] for r in before if name in r.lm_loss_by_dataset]
        if not base:
            continue
        median = statistics.median(base)
        values = [r for r in at if name in r.lm_loss_by_dataset]
        peak = max(values, key=lambda r: r.lm_loss_by_dataset[name])
        rises[name] = (peak.lm_loss_by_dataset[name] / median - 1 if median else 0.0, median, peak)
    if len(rises) < 2:  # one member is the average: nothing to single out
        return None
    name = named if named in rises else max(rises, key=lambda n: rises[n][0])
    rise, median, peak = rises[name]
    others = [r for n, (r, _, _) in rises.items() if n != name]
    if rise < ONE_SOURCE or any(2 * o > rise for o in others):
        return None
    tokens = peak.tokens_by_dataset
    share = tokens.get(name, 0) / max(sum(tokens.values()), 1)
    rest = ", ".join(f"{n} {r:+.0%}" for n, (r, _, _) in rises.items() if n != name) or "none"
    return name, (
        f"source {name}: {peak.lm_loss_by_dataset[name]:.4g} at iteration {peak.iteration}, "
        f"{rise:+.0%} over its own median {median:.4g} (other sources: {rest}); its share "
        f"{share:.0%} of the tokens dilutes it in the average"
    )


def _straggler(records: list[SignalRecord]) -> Question:
    q = "a rank named a straggler (slower than its peers, steps in a row) at the onset?"
    timed = [r for r in records if r.slowest_rank is not None]
    if not timed:
        missing = ["slowest_rank (signals: --signals-dir, DP > 1)"]
        return Question("straggler", q, "unknown", "per-rank step times not recorded", missing)
    named = next((r for r in timed if r.straggler_rank is not None), None)
    if named is None:
        last = timed[-1]
        why = (
            f"none named over iterations {timed[0].iteration}-{last.iteration} (slowest at "
            f"{last.iteration}: rank {last.slowest_rank}, {_fmt(last.slowest_step_time)} s vs "
            f"peers' {_fmt(last.median_step_time)} s)"
        )
        return Question("straggler", q, "no", why)
    why = (
        f"rank {named.straggler_rank} on {named.straggler_node} named at iteration "
        f"{named.iteration}: busy {_fmt(named.slowest_step_time)} s per step vs its peers' "
        f"{_fmt(named.median_step_time)} s"
    )
    return Question("straggler", q, "yes", why)


def _plateau(before: list[SignalRecord]) -> Question:
    q = "grad norm on a plateau below normal before the spike?"
    short = _history("optimizer-state", q, before, ["grad_norm"])
    if short is not None:
        return short
    grads = _values(before, "grad_norm")
    recent, earlier = statistics.median(grads[-RECENT:]), statistics.median(grads[:-RECENT])
    ratio = recent / earlier if earlier > 0 else 1.0
    why = (
        f"grad-norm median over the last {RECENT} iterations {recent:.4g} = "
        f"x{ratio:.3g} of the earlier {earlier:.4g} (plateau if <= x{PLATEAU:g})"
    )
    return Question("optimizer-state", q, "yes" if ratio <= PLATEAU else "no", why)


def _bf16(
    before: list[SignalRecord],
    at: list[SignalRecord],
    nxt: SignalRecord | None,
    grad_baseline: float | None,
    loss_threshold: float | None,
) -> Question:
    q = "no precursor, back the next step, num_zeros anomalous at the onset?"
    if nxt is None:
        return Question("bf16", q, "unknown", "no record after the onset")
    grad_back = (
        nxt.grad_norm is None or grad_baseline is None or nxt.grad_norm < GRAD_BACK * grad_baseline
    )
    loss_back = nxt.lm_loss is not None and (
        loss_threshold is None or nxt.lm_loss <= loss_threshold
    )
    zeros = _values(before, "num_zeros")
    onset_zeros = next((r.num_zeros for r in at if r.num_zeros is not None), None)
    missing: list[str] = []
    answer: Answer
    if len(zeros) < 3 or onset_zeros is None:
        zeros_text = "num_zeros not recorded"
        missing.append("num_zeros (--log-num-zeros-in-grad)")
        answer = "unknown" if grad_back and loss_back else "no"
    else:
        med = statistics.median(zeros)
        mad = statistics.median(abs(z - med) for z in zeros) * 1.4826
        anomaly = abs(onset_zeros - med) > max(ZEROS_K * mad, 1e-12 + 1e-3 * abs(med))
        zeros_text = f"num_zeros {onset_zeros:.6g} vs baseline {med:.6g} (sigma {mad:.3g})"
        answer = "yes" if grad_back and loss_back and anomaly else "no"
    why = (
        f"next step: loss {_fmt(nxt.lm_loss)} (back: {loss_back}), grad norm "
        f"{_fmt(nxt.grad_norm)} (back: {grad_back}); {zeros_text}"
    )
    return Question("bf16", q, answer, why, missing)


def diagnose(
    incident: dict[str, Any],
    records: list[SignalRecord],
    reproduced: bool = False,
) -> Diagnosis:
    """Walk the tree for ``incident`` (a ledger event) over ``records`` (one per iteration)."""
    onset, last = int(incident["onset"]), int(incident["iteration"])
    before = [r for r in records if onset - LOOKBACK <= r.iteration < onset]
    at = [r for r in records if onset <= r.iteration <= max(onset, min(last, onset + 2))]
    after = [r for r in records if onset <= r.iteration <= last]
    nxt = next((r for r in records if r.iteration == onset + 1), None)
    steps = [_divergence(incident, after), _logit(before), _learning_rate(before)]
    bad, culprit = _bad_data(before, at, reproduced)
    source = _bad_source(incident.get("culprit_source"), before, at)
    if source is not None:  # one blend member's own jump: evidence of bad data
        bad.evidence += f"; {source[1]}"
        bad.answer = "yes"
    steps += [bad, _straggler(before[-STRAGGLER_BEFORE:] + at), _plateau(before)]
    precursor = any(s.answer == "yes" for s in steps[1:])
    bf16 = _bf16(before, at[:1], nxt, incident.get("grad_baseline"), incident.get("loss_threshold"))
    if precursor and bf16.answer == "yes":
        bf16.answer, bf16.evidence = "no", bf16.evidence + "; but a precursor was found"
    steps.append(bf16)
    loss = incident.get("loss")
    nonfinite = isinstance(loss, float) and not math.isfinite(loss)
    cause = next((s.name for s in steps[1:] if s.answer == "yes"), None)
    cause = cause or ("non-finite" if nonfinite else "transient")
    if cause == "bad-data" and culprit is None and source is not None:
        cause = "bad-source"
    label, action = CAUSES[cause]
    if steps[0].answer == "yes":
        action = "roll back first, then: " + action
    missing = sorted({m for s in steps for m in s.missing})
    return Diagnosis(
        diverged=steps[0].answer == "yes",
        cause=cause,
        label=label,
        action=action,
        culprit_dp_rank=culprit if culprit is not None else incident.get("culprit_dp_rank"),
        steps=steps,
        missing=missing,
        culprit_source=source[0] if source is not None else None,
        first_layer=_first_layer(before + at[:1], onset),
    )


def _first_layer(records: list[SignalRecord], onset: int) -> str | None:
    """The layer whose grad norm rose first (GRAD_RISE × its median) in the RECENT
    iterations up to the onset, as 'name (iteration i, ×r)'; None when not recorded."""
    history = [(r.iteration, r.layer_grad_norms) for r in records if r.layer_grad_norms]
    recent = min(RECENT, max(1, (onset - history[0][0]) // 2)) if history else RECENT
    found = first_rising_layer(history, onset, recent, GRAD_RISE)
    return None if found is None else f"{found[0]} (iteration {found[1]}, x{found[2]:.3g})"
