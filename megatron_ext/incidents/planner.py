"""Offline rollback + skip planner (the PaLM recipe) — no Megatron imports.

Given the spike ledger, the signals log (all attempts), the checkpoint directory and earlier
skip lists, a :class:`Plan` says: load checkpoint ``T_c`` (the newest complete one at least
``rollback_iters`` before the incident's onset that Megatron can load: damaged ones are passed
over, with a note, and moved aside with the newer ones), skip the next ``n`` batches
(``T_c+1 … T_c+n``, which must reach past the incident), merged with every earlier skip, and
restart. Under the ``confirm`` policy the first rollback replays the same data; only an
incident that reproduces at the same onset in two attempts is treated as data-caused, skipped,
and written to Megatron's result-rejected tracker so plain Megatron skips it too.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from megatron_ext.common.errors import UsageError
from megatron_ext.common.files import (
    CHECKPOINT_COMMON_FILE,
    CHECKPOINT_DIR,
    CHECKPOINT_METADATA_FILE,
    LEGACY_RANK_DIR_GLOB,
    checkpoint_dir,
)
from megatron_ext.common.io import from_json
from megatron_ext.common.records.signals import SignalRecord
from megatron_ext.common.records.skip_ranges import to_ranges
from megatron_ext.incidents import repeats

# Walk the onset back while the grad norm was already this far above its baseline.
ONSET_GRAD_FACTOR = 2.0
# PaLM's 200-500 skipped batches are 10-25 time constants of Adam's v at beta2 = 0.95.
TIME_CONSTANTS = 10
# Damaged checkpoints a refusal names, newest first (the rest are counted).
NAMED = 5


def rounded(value: Any) -> Any:
    """A float for people (4 significant digits, as Megatron's logs show losses); anything
    else as is. The plan's JSON keeps the full values."""
    return f"{value:.4g}" if isinstance(value, float) else value


class PlanError(UsageError, RuntimeError):
    """The plan is impossible or the inputs are inconsistent; the message says what to do."""


@dataclass(frozen=True)
class PlanConfig:
    rollback_iters: int = 100
    skip_batches: int | None = 300
    beta2: float | None = None  # when set: n = ceil(TIME_CONSTANTS / (1 - beta2))
    policy: Literal["skip", "confirm"] = "skip"

    def batches(self) -> int:
        if self.beta2 is not None:
            if not 0 < self.beta2 < 1:
                raise PlanError(f"--skip-from-beta2 {self.beta2}: need 0 < beta2 < 1")
            return math.ceil(TIME_CONSTANTS / (1.0 - self.beta2))
        if not self.skip_batches or self.skip_batches < 1:
            raise PlanError("--skip-batches must be >= 1")
        return self.skip_batches


@dataclass
class Plan:
    """What to do about one incident; written as JSON, read by people and the launcher."""

    incident: dict[str, Any]
    action: Literal["rollback-and-skip", "rollback-and-replay"]
    onset: int
    rollback_to: int
    skip_window: list[int] | None  # [first, last], inclusive, or None (replay)
    skip_ranges: list[list[int]]  # everything to skip from now on, merged
    moved_checkpoints: list[int]
    restart_args: list[str]
    summary: str
    tracker_lines: list[str] = field(default_factory=list)
    # The batch the window was planned at and the consumed samples [first, last] it stands
    # for (None: the rollback target's args could not be read): training places these samples
    # at the global batch in force when it resumes (records.skip_ranges).
    global_batch_size: int | None = None
    skip_samples: list[int] | None = None
    # Newer candidates that Megatron could not load: [{"checkpoint": N, "problem": "..."}].
    passed_over: list[dict[str, Any]] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def _complete(directory: Path) -> bool:
    return (
        (directory / CHECKPOINT_METADATA_FILE).exists()
        or (directory / CHECKPOINT_COMMON_FILE).exists()
        or any(directory.glob(LEGACY_RANK_DIR_GLOB))
    )


def complete_newest_first(ckpt_dir: Path) -> Iterator[int]:
    """Iterations with a complete checkpoint directory (torch_dist metadata or legacy files),
    newest first, each checked only when the caller gets that far.

    Why lazily: a long run keeps tens of thousands of checkpoints (50 k took 3.5 s with a
    completeness check each), and a plan needs only the newest usable one at or before its
    limit and every one after it. The names come from one directory read (``scandir``: no
    stat per entry on local filesystems).
    """
    try:
        with os.scandir(ckpt_dir) as entries:
            named = sorted(
                int(match[1])
                for entry in entries
                if (match := CHECKPOINT_DIR.match(entry.name)) and entry.is_dir()
            )
    except (FileNotFoundError, NotADirectoryError):
        return
    for iteration in reversed(named):
        if _complete(checkpoint_dir(ckpt_dir, iteration)):
            yield iteration


def take_down_to(newest_first: Iterator[int], down_to: int | None) -> list[int]:
    """From ``newest_first``, every iteration down to the first one at or before ``down_to``
    (all: None), oldest first; the iterator then goes on with the older ones."""
    found = []
    for iteration in newest_first:
        found.append(iteration)
        if down_to is not None and iteration <= down_to:
            break
    return found[::-1]


def choose_target(
    checkpoints: list[int],
    limit: int,
    problem: Callable[[int], str | None] | None,
    older: Iterable[int] = (),
) -> tuple[int, list[dict[str, Any]]]:
    """The newest checkpoint at or before ``limit`` that ``problem`` finds nothing wrong with
    (none given: the newest), and the damaged ones passed over on the way, each with what is
    wrong. ``older``: complete checkpoints older than ``checkpoints[0]``, newest first, read
    only when every candidate in ``checkpoints`` is damaged. Each candidate is verified only
    when it is reached, so a run of healthy checkpoints costs one verification."""
    passed_over: list[dict[str, Any]] = []
    listed = reversed([c for c in checkpoints if c <= limit])
    for candidate in itertools.chain(listed, (c for c in older if c <= limit)):
        found = problem(candidate) if problem else None
        if found is None:
            return candidate, passed_over
        passed_over.append({"checkpoint": candidate, "problem": found})
    if passed_over:
        damaged = "; ".join(f"{p['checkpoint']}: {p['problem']}" for p in passed_over[:NAMED])
        if len(passed_over) > NAMED:
            damaged += f"; and {len(passed_over) - NAMED} older ones"
        raise PlanError(
            f"no loadable checkpoint at or before iteration {limit}: every one is damaged "
            f"({damaged}). Nothing was changed. Restore one of them from a backup, or lower "
            "--rollback-iters if a newer one is intact."
        )
    raise PlanError(
        f"no complete checkpoint at or before iteration {limit}; available: "
        f"{checkpoints or 'none'}. Lower --rollback-iters or restore an older checkpoint."
    )


def _checked(event: dict[str, Any]) -> dict[str, Any]:
    """A ledger event with its numbers checked: iterations are integers, measurements numbers
    (``"NaN"``/``"Infinity"`` strings included) or null; anything else is a damaged line."""
    event = from_json(event)
    for key in ("iteration", "onset"):
        value = event.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(
                f"a {event.get('kind')} record of the spike ledger has {key}={value!r}, not an "
                "iteration number: the ledger line is damaged or was not written by the "
                f"detector; fix or remove it (record: {str(event)[:200]})"
            )
    for key in ("loss", "loss_baseline", "grad_norm", "grad_baseline"):
        value = event.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise PlanError(
                f"a {event.get('kind')} record of the spike ledger at iteration "
                f"{event['iteration']} has {key}={value!r}, not a number: fix or remove the line"
            )
    return event


def latest_incident(ledger: list[dict[str, Any]]) -> dict[str, Any]:
    """The newest rollback request in the ledger."""
    rollbacks = [e for e in ledger if e.get("kind") == "rollback"]
    if not rollbacks:
        raise PlanError(
            "the spike ledger holds no rollback request: nothing to plan "
            "(transient spikes that recovered need no rollback)"
        )
    return _checked(rollbacks[-1])


def incident_id(incident: dict[str, Any]) -> str:
    """A rollback request's identity: its attempt, iteration and onset (one per request)."""
    return (
        f"attempt{incident.get('attempt', 0)}-iteration{incident['iteration']}"
        f"-onset{incident['onset']}"
    )


def check_unhandled(
    incident: dict[str, Any],
    applied: list[dict[str, Any]],
    checkpoints: list[int],
    tracker: int | None,
) -> dict[str, Any] | None:
    """Refuse an incident the run is already past; return its applied record when it was
    applied and nothing was trained since (then there is nothing left to do).

    - applied, and a checkpoint newer than its rollback target exists: those were trained
      after the rollback (the apply moved every newer one aside), and applying again would
      discard them;
    - never applied, but the tracker names a checkpoint saved after the incident's iteration:
      the run trained past it some other way (a manual restart), so it is history.
    """
    ident = incident_id(incident)
    record = next((r for r in applied if r.get("incident_id") == ident), None)
    where = (
        f"the rollback request at iteration {incident['iteration']} (onset {incident['onset']}, "
        f"attempt {incident.get('attempt')})"
    )
    if record is not None:
        newer = [c for c in checkpoints if c > int(record["rollback_to"])]
        if newer:
            raise PlanError(
                f"{where} was already applied as incident {int(record['incident']):03d} (rolled "
                f"back to {record['rollback_to']}, skipped {record.get('skip_window')}), and the "
                f"run has trained past it since: checkpoint(s) {newer} were saved after that "
                "rollback. Applying it again would discard them; nothing to do. A new spike "
                "gets its own rollback request in the ledger."
            )
        return record
    if tracker is not None and tracker > int(incident["iteration"]):
        raise PlanError(
            f"{where} is older than checkpoint {tracker}, which the tracker names and which "
            "was saved after it: the run has trained past this incident, so it is not the "
            "current one. Nothing to plan; to roll back anyway, point "
            "latest_checkpointed_iteration.txt at an older checkpoint yourself."
        )
    return None


def find_onset(incident: dict[str, Any], signals: list[SignalRecord]) -> int:
    """The incident's onset, moved earlier while the grad norm was already elevated."""
    onset = int(incident["onset"])
    baseline = incident.get("grad_baseline")
    if not baseline or not math.isfinite(baseline):  # no usable baseline: keep the onset
        return onset
    attempt = incident.get("attempt")
    grads = {r.iteration: r.grad_norm for r in signals if r.attempt == attempt}
    while (g := grads.get(onset - 1)) is not None and g >= ONSET_GRAD_FACTOR * baseline:
        onset -= 1
    return onset


def reproduced(incident: dict[str, Any], ledger: list[dict[str, Any]]) -> bool:
    """Whether an earlier attempt had an incident with the same onset (bad-data fingerprint)."""
    attempts = {
        e.get("attempt")
        for e in ledger
        if e.get("kind") in ("spike", "divergence") and e.get("onset") == incident["onset"]
    }
    return len(attempts) >= 2


def tracker_lines(incident: dict[str, Any], ledger: list[dict[str, Any]]) -> list[str]:
    """Lines Megatron's get_skipped_iterations_from_tracker_file counts: the same
    (rank, iteration) reported once per attempt, each attempt by a single rank."""
    rank = incident.get("culprit_dp_rank") or 0
    attempts = sorted(
        {
            e.get("attempt")
            for e in ledger
            if e.get("onset") == incident["onset"] and e.get("kind") in ("spike", "divergence")
        }
    )
    return [
        f"ts=megatron-ext node=megatron-ext device=megatron-ext jobID=attempt-{a} rank={rank} "
        f"iteration={incident['onset']} status=RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE "
        f"result={incident.get('loss')} message='megatron-ext: loss spike reproduced at the "
        f"same iteration after a rollback'\n"
        for a in attempts
    ]


def make_plan(
    ledger: list[dict[str, Any]],
    signals: list[SignalRecord],
    checkpoints: list[int],
    earlier_skips: list[int],
    config: PlanConfig,
    train_iters: int | None,
    ckpt_dir: str,
    batch_at: Callable[[int], tuple[int, int] | None] | None = None,
    problem: Callable[[int], str | None] | None = None,
    older: Iterable[int] = (),
    applied: list[dict[str, Any]] | None = None,
) -> Plan:
    """Decide the rollback target and skip window for the newest incident. ``batch_at(c)``
    gives checkpoint c's consumed samples and global batch, so the window is also recorded in
    samples (what stays bad when the batch size changes). ``problem(c)`` says why Megatron
    could not load checkpoint c (None: it can), ``older`` goes on past ``checkpoints`` (see
    :func:`choose_target`); damaged candidates are moved aside with the newer ones, so that
    nothing newer than the target stays where the run would find it. ``applied``: the
    rollbacks applied so far; one this incident repeats goes further (:mod:`.repeats`)."""
    incident = latest_incident(ledger)
    onset = find_onset(incident, signals)
    replay = config.policy == "confirm" and not reproduced(incident, ledger)
    chain = [] if replay else repeats.repeated(incident, applied or [], config.batches())
    if (refusal := repeats.refuse_if_exhausted(chain, onset)) is not None:
        raise PlanError(refusal)
    limit = repeats.limit(chain, onset - config.rollback_iters)
    try:
        target, passed_over = choose_target(checkpoints, limit, problem, older)
    except PlanError as exc:
        raise PlanError(
            f"{exc} (limit {limit} = onset {onset} - --rollback-iters {config.rollback_iters})"
        ) from None
    moved = sorted({c for c in checkpoints if c > target} | {p["checkpoint"] for p in passed_over})
    skips = set(earlier_skips)
    window = None
    if not replay:
        n = config.batches()
        window = [target + 1, repeats.window_end(chain, target, int(incident["iteration"]), n)]
        if window[1] < int(incident["iteration"]):
            raise PlanError(
                f"skip window {window[0]}-{window[1]} does not reach the incident at iteration "
                f"{incident['iteration']}: use --skip-batches >= {incident['iteration'] - target}"
            )
        if train_iters is not None and window[1] > train_iters:
            raise PlanError(
                f"skip window {window[0]}-{window[1]} runs past --train-iters "
                f"{train_iters}: use fewer --skip-batches"
            )
        skips |= set(range(window[0], window[1] + 1))
    at = batch_at(target) if window and batch_at else None
    samples = [at[0], at[0] + (window[1] - window[0] + 1) * at[1] - 1] if window and at else None
    ranges = [list(r) for r in to_ranges(sorted(skips))]
    action = "rollback-and-replay" if replay else "rollback-and-skip"
    skip_text = ", ".join(f"{a}-{b}" for a, b in ranges) or "none"
    summary = (
        f"{incident['kind']} requested at iteration {incident['iteration']} (onset {onset}, "
        f"{incident.get('classification')}, culprit DP rank {incident.get('culprit_dp_rank')}, "
        + (
            f"culprit source {incident['culprit_source']}, "
            if incident.get("culprit_source")
            else ""
        )
        + f"loss {rounded(incident.get('loss'))} vs baseline "
        f"{rounded(incident.get('loss_baseline'))}). "
        f"Roll back to checkpoint {target}"
        + "".join(
            f" (passed over checkpoint {p['checkpoint']}, which cannot be loaded: {p['problem']})"
            for p in passed_over
        )
        + (
            f", skip iterations {window[0]}-{window[1]}"
            + (f" (samples {samples[0]}-{samples[1]} at global batch {at[1]})" if at else "")
            if window
            else ", replay the same data to confirm (confirm policy, first occurrence)"
        )
        + f"; all skipped iterations: {skip_text}."
        + repeats.note(chain)
    )
    return Plan(
        incident=incident,
        action=action,
        onset=onset,
        rollback_to=target,
        skip_window=window,
        skip_ranges=ranges,
        moved_checkpoints=moved,
        restart_args=[
            "--load",
            ckpt_dir,
            "--iterations-to-skip",
            *(f"{a}-{b}" if a != b else str(a) for a, b in ranges),
        ],
        summary=summary,
        global_batch_size=at[1] if at else None,
        skip_samples=samples,
        passed_over=passed_over,
        tracker_lines=[]
        if replay or config.policy != "confirm"
        else tracker_lines(incident, ledger),
    )
