"""Offline rollback + skip planner (the PaLM recipe): no Megatron imports.

A :class:`Plan` loads the newest loadable checkpoint at least ``rollback_iters`` before the
onset, skips the next ``n`` batches (with every earlier skip) and restarts; a failure that
comes back within an applied rollback's reach repeats it further back, at most
:data:`MAX_REPEATS` times. docs/incidents.md.
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
from megatron_ext.common.records.skip_ranges import format_ranges, to_ranges

ONSET_GRAD_FACTOR = 2.0  # the onset moves back while the grad norm was this far up already
TIME_CONSTANTS = 10  # of Adam's v: PaLM's 200-500 batches are 10-25 at beta2 = 0.95
NAMED = 5  # damaged checkpoints a refusal names, newest first (the rest are counted)
MAX_REPEATS = 2  # rollbacks of one failure that each went further back, before refusing


def rounded(value: Any) -> Any:
    """A float for people (4 significant digits, as Megatron's logs show losses)."""
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
    # The window's batch and samples [first, last] (None: the target's args were unreadable).
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
    """Iterations with a complete checkpoint directory, newest first, checked lazily."""
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
    (all: None), oldest first."""
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
    """The newest checkpoint at or before ``limit`` that ``problem`` finds nothing wrong with,
    and the damaged ones passed over; ``older`` (newest first) is read only if all are damaged."""
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


# The optional fields of a rollback request, the type each must have, and its name in refusals.
_TYPED_FIELDS = (
    *((key, int, "a whole number") for key in ("attempt", "culprit_dp_rank")),
    *(
        (key, int | float, "a number")
        for key in ("loss", "loss_baseline", "grad_norm", "grad_baseline")
    ),
)


def latest_incident(ledger: list[dict[str, Any]]) -> dict[str, Any]:
    """The newest rollback request in the ledger, its iterations and measurements checked."""
    rollbacks = [e for e in ledger if e.get("kind") == "rollback"]
    if not rollbacks:
        raise PlanError(
            "the spike ledger holds no rollback request: nothing to plan "
            "(transient spikes that recovered need no rollback)"
        )
    event = from_json(rollbacks[-1])
    for key in ("iteration", "onset"):
        value = event.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(
                f"a {event.get('kind')} record of the spike ledger has {key}={value!r}, not an "
                "iteration number: the ledger line is damaged or was not written by the "
                f"detector; fix or remove it (record: {str(event)[:200]})"
            )
    if event["onset"] > event["iteration"]:
        raise PlanError(
            f"a {event.get('kind')} record of the spike ledger has onset={event['onset']} after "
            f"its iteration {event['iteration']}: the ledger line is damaged; fix or remove it"
        )
    for key, kind, what in _TYPED_FIELDS:
        value = event.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
            raise PlanError(
                f"a {event.get('kind')} record of the spike ledger at iteration "
                f"{event['iteration']} has {key}={value!r}, not {what}: fix or remove the line"
            )
    return event


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
    applied and nothing was trained since."""
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


def _attempts(incident: dict[str, Any], ledger: list[dict[str, Any]]) -> set[Any]:
    """The attempts that had an incident with this one's onset."""
    return {
        e.get("attempt")
        for e in ledger
        if e.get("kind") in ("spike", "divergence") and e.get("onset") == incident["onset"]
    }


def reproduced(incident: dict[str, Any], ledger: list[dict[str, Any]]) -> bool:
    """Whether an earlier attempt had an incident with the same onset (bad-data fingerprint)."""
    return len(_attempts(incident, ledger)) >= 2


def tracker_lines(incident: dict[str, Any], ledger: list[dict[str, Any]]) -> list[str]:
    """Lines Megatron's get_skipped_iterations_from_tracker_file counts: the same
    (rank, iteration) reported once per attempt, each attempt by a single rank."""
    rank = incident.get("culprit_dp_rank") or 0
    return [
        f"ts=megatron-ext node=megatron-ext device=megatron-ext jobID=attempt-{a} rank={rank} "
        f"iteration={incident['onset']} status=RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE "
        f"result={incident.get('loss')} message='megatron-ext: loss spike reproduced at the "
        f"same iteration after a rollback'\n"
        for a in sorted(_attempts(incident, ledger))
    ]


def repeated(incident: dict[str, Any], applied: list[dict[str, Any]], n: int) -> list[dict]:
    """The applied rollbacks (oldest first) whose target and window end + ``n`` enclose
    ``incident``'s onset."""
    chain: list[dict[str, Any]] = []
    onset = int(incident["onset"])
    for record in reversed(applied):
        window = record.get("skip_window")
        if not window or record.get("action") != "rollback-and-skip":
            break
        if not int(record["rollback_to"]) < onset <= int(window[1]) + n:
            break
        chain.append(record)
        onset = int(record["onset"])
    return chain[::-1]


def _tried(chain: list[dict[str, Any]]) -> str:
    return "; ".join(
        f"incident {int(r['incident']):03d} (onset {r['onset']}): rolled back to "
        f"{r['rollback_to']}, skipped {r['skip_window'][0]}-{r['skip_window'][1]}"
        for r in chain
    )


def _skip_window(
    incident: dict[str, Any],
    chain: list[dict[str, Any]],
    target: int,
    n: int,
    train_iters: int | None,
) -> list[int]:
    """From the target to past every window and incident seen, plus ``n``."""
    iteration = int(incident["iteration"])
    reached = [iteration, *(int(r["skip_window"][1]) for r in chain)]
    window = [target + 1, max(target + n, max(reached) + n) if chain else target + n]
    if window[1] < iteration:
        raise PlanError(
            f"skip window {window[0]}-{window[1]} does not reach the incident at iteration "
            f"{incident['iteration']}: use --skip-batches >= {incident['iteration'] - target}"
        )
    if train_iters is not None and window[1] > train_iters:
        raise PlanError(
            f"skip window {window[0]}-{window[1]} runs past --train-iters "
            f"{train_iters}: use fewer --skip-batches"
        )
    return window


def _summary(plan: Plan, chain: list[dict[str, Any]]) -> str:
    incident, window, samples = plan.incident, plan.skip_window, plan.skip_samples
    source = incident.get("culprit_source")
    passed = "".join(
        f" (passed over checkpoint {p['checkpoint']}, which cannot be loaded: {p['problem']})"
        for p in plan.passed_over
    )
    if window is None:
        what = ", replay the same data to confirm (confirm policy, first occurrence)"
    else:
        what = f", skip iterations {window[0]}-{window[1]}"
        if samples is not None:
            what += f" (samples {samples[0]}-{samples[1]} at global batch {plan.global_batch_size})"
    repeat = (
        f" The same failure came back after {_tried(chain)}: rolling back to a checkpoint older "
        f"than every target tried and skipping past every window seen (repeat {len(chain)} of "
        f"at most {MAX_REPEATS})."
        if chain
        else ""
    )
    skip_text = ", ".join(f"{a}-{b}" for a, b in plan.skip_ranges) or "none"
    return (
        f"{incident['kind']} requested at iteration {incident['iteration']} (onset {plan.onset}, "
        f"{incident.get('classification')}, culprit DP rank {incident.get('culprit_dp_rank')}, "
        + (f"culprit source {source}, " if source else "")
        + f"loss {rounded(incident.get('loss'))} vs baseline "
        f"{rounded(incident.get('loss_baseline'))}). Roll back to checkpoint {plan.rollback_to}"
        f"{passed}{what}; all skipped iterations: {skip_text}.{repeat}"
    )


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
    """Decide the rollback target and skip window for the newest incident. ``batch_at(c)``:
    checkpoint c's consumed samples and global batch; ``problem(c)``: why c cannot load."""
    if config.rollback_iters < 1:
        raise PlanError(
            f"--rollback-iters {config.rollback_iters}: must be >= 1 (the checkpoint at the "
            "onset already holds the onset's update, and the skip window starts after it)"
        )
    incident = latest_incident(ledger)
    onset = find_onset(incident, signals)
    confirm = config.policy == "confirm"
    replay = confirm and not reproduced(incident, ledger)
    chain = [] if replay else repeated(incident, applied or [], config.batches())
    if len(chain) > MAX_REPEATS:
        raise PlanError(
            f"the failure came back at onset {onset} after {len(chain)} rollbacks that each "
            f"rolled back further and skipped more ({_tried(chain)}); stopping instead of rolling "
            "back again. Likely: a checkpoint that fails after every load (Megatron-LM #5281: "
            "compare the losses right after each resume), a persistent GPU fault (the ranks and "
            "nodes in the ledger and Megatron's result-rejected tracker), or bad data longer than "
            "every window (`megatron-ext lookup` of the onsets). Fix the cause, then relaunch; "
            "`skiplist --undo` reverts the last rollback"
        )
    limit = min([onset - config.rollback_iters, *(int(r["rollback_to"]) - 1 for r in chain)])
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
        window = _skip_window(incident, chain, target, config.batches(), train_iters)
        skips |= set(range(window[0], window[1] + 1))
    at = batch_at(target) if window and batch_at else None
    samples = [at[0], at[0] + (window[1] - window[0] + 1) * at[1] - 1] if window and at else None
    skipped = sorted(skips)
    plan = Plan(
        incident=incident,
        action="rollback-and-replay" if replay else "rollback-and-skip",
        onset=onset,
        rollback_to=target,
        skip_window=window,
        skip_ranges=[list(r) for r in to_ranges(skipped)],
        moved_checkpoints=moved,
        restart_args=["--load", ckpt_dir, "--iterations-to-skip", *format_ranges(skipped).split()],
        summary="",
        global_batch_size=at[1] if at else None,
        skip_samples=samples,
        passed_over=passed_over,
        tracker_lines=tracker_lines(incident, ledger) if confirm and not replay else [],
    )
    plan.summary = _summary(plan, chain)
    return plan
