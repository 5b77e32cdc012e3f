"""Which attempts trained an iteration, and what became of each training of it.

A run is a sequence of attempts (a launch, a requeue, a restart after a rollback). After a
spike drill the onset was trained by attempt 1, then rolled back, and attempt 2 skipped it:
answering with the last attempt alone says "skipped, not trained on" about the very batch the
incident is about. So an iteration is answered per attempt:

- the attempts come from the layout history (:mod:`.history`: one layout-log line per
  attempt, in the order they ran; without the log, one segment per attempt that left
  checkpoints);
- attempt ``a`` trained iteration ``k`` when it started at or before ``k`` and did not skip
  it; a later attempt that started at or before ``k`` rolled that training back, and it then
  either trained ``k`` again or skipped it. Whether a rolled-back attempt got as far as ``k``
  only its records in the sample log can tell: one rank's records of ``k`` are read (a few
  8 KiB reads, :mod:`megatron_ext.common.records.sample_log_reader`). One that stopped before ``k``
  (a plain resume, a rollback from before ``k``) is left out; without a sample log it is
  listed as one that may have trained it, and not chosen as the answer;
- a sample-log attempt (one ``attempts-dp{rank}.jsonl`` line, written at its first record) is
  the layout-log attempt that started last before it, by wall time;
- the default answer is the latest attempt that *trained* ``k`` (the onset batch, not the
  skip that followed); ``--attempt N`` answers for another;
- an iteration past everything the run recorded (sample log, checkpoints, resumes) is not
  trained yet: :class:`NotTrained`, exit status 3, no batch shown as if it were.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_ext.common.files import sample_log_file
from megatron_ext.common.records.sample_log_reader import Attempt, AttemptRecords, RankLog
from megatron_ext.lookup.errors import ConfigError, NotTrained
from megatron_ext.lookup.history import History, Segment


@dataclass(frozen=True)
class AttemptAt:
    """One attempt that started at or before the iteration, and what it did with it."""

    number: int  # 1-based, in the order the attempts ran
    segment: Segment
    trained: bool  # it trained the iteration (False: skipped it, or never got that far)
    fate: str  # what it did, and what became of it

    def describe(self) -> str:
        job = f", job {self.segment.job_id}" if self.segment.job_id else ""
        return f"attempt {self.number} (from iteration {self.segment.first}{job}): {self.fate}"


def attempt_number(segments: tuple[Segment, ...], attempt: Attempt) -> int | None:
    """The layout-log attempt that wrote a sample-log attempt; None when it cannot be placed
    (a stretch the attempt index does not vouch for, or no wall times)."""
    wall = attempt.info.get("wall_time") if attempt.indexed else None
    if not isinstance(wall, int | float):
        return None
    # No slack for node clocks: a rank writes its attempt line after its first step, seconds
    # after rank 0's layout line, and NTP keeps nodes milliseconds apart.
    started = [
        n for n, s in enumerate(segments, start=1) if s.started is not None and s.started <= wall
    ]
    return started[-1] if started else None


@dataclass(frozen=True)
class Attempts:
    """The attempts at one iteration, and the evidence they were judged on."""

    iteration: int
    at: list[AttemptAt]
    logged: dict[int | None, list[AttemptRecords]]  # attempt number -> its records (one rank)
    log_read: bool  # a sample log was read for the evidence
    caveat: str | None = None  # said when no record tells whether the run got this far

    def answer(self, asked: int | None) -> AttemptAt:
        """``--attempt N``, else the latest attempt that trained the iteration, else the
        latest that reached it (it skipped it)."""
        if asked is not None:
            chosen = [a for a in self.at if a.number == asked]
            if not chosen:
                raise ConfigError(
                    f"--attempt {asked}: the attempts that started at or before iteration "
                    f"{self.iteration} are {[a.number for a in self.at]}"
                )
            return chosen[0]
        trained = [a for a in self.at if a.trained]
        return (trained or self.at)[-1]

    def lines(self, answered: AttemptAt) -> list[str]:
        out = [f"note: {self.caveat}"] if self.caveat else []
        if len(self.at) == 1 and self.at[0].trained and self.at[0].number == 1:
            return out  # one attempt, nothing rolled back: the usual answer needs no more
        out.append(f"answer: what attempt {answered.number} read at iteration {self.iteration}")
        out.append(f"attempts at iteration {self.iteration}:")
        out += [f"  {a.describe()}" for a in self.at]
        if not self.log_read:
            out.append(
                "  (no sample log read: whether a rolled-back attempt got this far is not known)"
            )
        return out


def attempts_at(history: History, iteration: int, sample_log: str | None, rank: int) -> Attempts:
    """Judge every attempt at ``iteration`` from the history and one rank's sample log."""
    segments = history.attempts()
    logged: dict[int | None, list[AttemptRecords]] = {}
    last_logged = None
    path = sample_log_file(sample_log, rank) if sample_log else None
    log_read = path is not None and path.is_file()
    if log_read:
        assert path is not None
        with RankLog(path, rank) as log:
            for group in log.iteration(iteration):
                logged.setdefault(attempt_number(segments, group.attempt), []).append(group)
            last_logged = log.last_iteration()
    covering = [(n, s) for n, s in enumerate(segments, start=1) if s.first <= iteration]
    if not logged:
        _check_reached(history, iteration, last_logged, log_read, Path(str(sample_log)))
    if not covering:
        history.segment_for(iteration)  # raises: a gap of the layout history
    final_number, final = covering[-1]
    at = []
    for k, (number, segment) in enumerate(covering):
        later = covering[k + 1] if k + 1 < len(covering) else None
        if iteration in segment.skips:
            at.append(AttemptAt(number, segment, False, "skipped it (--iterations-to-skip)"))
            continue
        if later is None:
            newest = history.newest_checkpoint()
            kept = (
                f"kept (checkpoint {newest} holds it)"
                if newest is not None and newest >= iteration
                else f"no checkpoint holds it yet (newest: {newest})"
            )
            at.append(AttemptAt(number, segment, True, f"trained it; {kept}"))
            continue
        if log_read and number not in logged and None not in logged:
            continue  # it stopped, or was rolled back, before this iteration: not an answer
        if not log_read:
            fate = (
                f"may have trained it before attempt {later[0]} resumed from iteration "
                f"{later[1].first - 1} (no sample log to tell; --attempt {number} shows what "
                "it read if it did)"
            )
            at.append(AttemptAt(number, segment, False, fate))
            continue
        then = "skipped afterwards" if iteration in final.skips else "trained again"
        fate = (
            f"trained it; rolled back (attempt {later[0]} resumed from iteration "
            f"{later[1].first - 1}), {then} by attempt {final_number}"
        )
        at.append(AttemptAt(number, segment, True, fate))
    caveat = None
    newest = history.newest_checkpoint()
    if not log_read and iteration > max([newest or 0] + [s.first - 1 for s in segments]):
        caveat = (
            f"iteration {iteration} is past the newest checkpoint ({newest}) and no sample log "
            "is at hand: nothing says whether the run trained it yet (this is the batch it "
            "reads there)"
        )
    return Attempts(iteration, at, logged, log_read, caveat)


def _check_reached(
    history: History, iteration: int, last_logged: int | None, log_read: bool, log: Path
) -> None:
    """Refuse an iteration past everything the run recorded (when a sample log says so)."""
    resumes = [s.first - 1 for s in history.attempts()]
    reached = max(
        [i for i in (last_logged, history.newest_checkpoint(), *resumes) if i is not None],
        default=0,
    )
    if log_read and iteration > reached:
        newest = history.newest_checkpoint()
        raise NotTrained(
            f"iteration {iteration} is not yet trained: the run's sample log ({log}) ends at "
            f"iteration {last_logged}, its newest checkpoint is "
            f"{'none' if newest is None else newest}. Ask again once the run got there"
        )
