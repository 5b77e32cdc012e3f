"""What the supervisor does after a training attempt ends: the exit-code policy, as data.

Pure functions: :func:`decide` maps how an attempt ended and the budgets to one
:class:`Decision` (the table: ``megatron_ext.supervise.cli.EXIT_CODES``); the runner carries it
out. A worker SIGKILLed from outside the job (137 recorded by its live rank wrapper: OOM killer,
operator, failing node) is restarted and outranks its peers' consequent failures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_ext.common import exit_codes
from megatron_ext.common.attempt_end import AttemptEnd

Action = Literal["finish", "restart", "rollback", "stop"]


@dataclass(frozen=True)
class Outcome:
    """How one attempt ended."""

    launcher_rc: int
    rank_codes: tuple[int, ...]  # what each worker reported (torchrun itself says 1)
    spike_code: int
    # Whether the spike ledger gained a rollback request during the attempt; None when the
    # run keeps no ledger (no --signals-dir: a custom MEGATRON_EXT_ON_SPIKE hook decides).
    ledger_confirms: bool | None = None
    workers: tuple[str, ...] = ()  # who reported each rank code ("rank 1 on n2"); may be empty
    # How the training said it ended (None: a crash, or a script of the user's own), and the
    # checkpoint tracker before and after the attempt.
    ended: AttemptEnd | None = None
    tracker: tuple[int | None, int | None] = (None, None)
    # The hang watchdog's finding (exit 43), and whether the previous attempt hung alike.
    hang: str | None = None
    hang_repeats: bool = False

    def progressed(self) -> bool:
        """Whether the attempt left a newer checkpoint than it started from."""
        before, after = self.tracker
        return after is not None and (before is None or after > before)

    def effective(self) -> int:
        """The code that matters: 17, the spike code, 16, a hang (43: its peers' failures follow)
        or a SIGKILL (137) that a worker reported, in that order; then a worker's first other
        non-zero code below 128 (not a signal death); else the launcher's."""
        if self.launcher_rc == 0:
            return 0
        if self.rank_codes and not any(self.rank_codes) and self.launcher_rc < 128:
            # Every worker ended cleanly: torchrun's own 1 after it was signalled too (it
            # forwards the signal, the workers save and exit 0) is not a failure.
            return 0
        for wanted in (
            exit_codes.FAILED_ON_RESULT_VALIDATION,
            self.spike_code,
            exit_codes.RESUME_TO_DISAMBIGUATE,
            exit_codes.HUNG,
            exit_codes.KILLED,
        ):
            if wanted in self.rank_codes:
                return wanted
        for code in self.rank_codes:
            if 0 < code < 128:
                return code
        return self.launcher_rc

    def killed(self) -> list[str]:
        """The workers that died of SIGKILL, named as in :attr:`workers`."""
        return [
            self.workers[i] if i < len(self.workers) else f"worker {i}"
            for i, code in enumerate(self.rank_codes)
            if code == exit_codes.KILLED
        ]


@dataclass(frozen=True)
class Budget:
    restarts_done: int  # SLURM_RESTART_COUNT + relaunches in this allocation
    max_restarts: int
    rollbacks_done: int
    max_rollbacks: int
    requeue: bool  # RESTART_MODE=requeue (else relaunch in place)

    @property
    def spent(self) -> str | None:
        """How the restart budget was spent, when it was (None: restarts are left)."""
        if self.restarts_done < self.max_restarts:
            return None
        return f"{self.restarts_done} restarts so far, MAX_RESTARTS={self.max_restarts}"

    @property
    def next_restart(self) -> str:
        return f"restart {self.restarts_done + 1}/{self.max_restarts}"


@dataclass(frozen=True)
class Decision:
    action: Action
    exit_code: int  # the launcher's exit status when it stops (0 after a requeue)
    reason: str
    requeue: bool = False  # for "restart": scontrol requeue instead of relaunching here
    charged: bool = True  # for "restart": counts against MAX_RESTARTS


def decide(outcome: Outcome, budget: Budget) -> Decision:
    """The row of the exit-code table that applies to ``outcome``."""
    code = outcome.effective()
    if code == 0:
        return _after_clean_exit(outcome, budget)
    if code == exit_codes.HUNG and outcome.hang_repeats:
        return Decision(
            "stop",
            code,
            f"{outcome.hang}: the same hang as the previous attempt (same iteration, same "
            "place), so a restart would hang again; read the stacks in the hang report",
        )
    cause = _restart_cause(outcome, code)
    if cause is not None:
        return _restart(code, cause, budget)
    if code == exit_codes.FAILED_ON_RESULT_VALIDATION:
        return Decision(
            "stop",
            code,
            "a result validation failed in Megatron's rerun state "
            "machine and the failure was reproducible or hardware-suspect",
        )
    if code == outcome.spike_code:
        return _rollback(code, outcome.ledger_confirms, budget)
    return Decision("stop", code, f"training failed with exit code {code}; stopping")


def _restart_cause(outcome: Outcome, code: int) -> str | None:
    """Why ``code`` restarts (16, a hang, a SIGKILLed worker), as the reason's start; None
    when it does not."""
    killed = outcome.killed() if code == exit_codes.KILLED else []
    if killed:
        return (
            f"{', '.join(killed)} killed by SIGKILL (the out-of-memory killer, an operator "
            "or a failing node; see the node's kernel log); "
        )
    if code == exit_codes.HUNG:
        return f"{outcome.hang or 'a rank made no progress'}; "
    return "" if code == exit_codes.RESUME_TO_DISAMBIGUATE else None


def _restart(code: int, cause: str, budget: Budget) -> Decision:
    """Restart from the last checkpoint within MAX_RESTARTS (16, a hang, a SIGKILLed worker)."""
    if budget.spent:
        return Decision(
            "stop", code, f"{cause}restart budget exhausted ({budget.spent}); giving up"
        )
    return Decision("restart", code, f"{cause}{budget.next_restart}", requeue=budget.requeue)


def _rollback(code: int, ledger_confirms: bool | None, budget: Budget) -> Decision:
    """The spike exit code: a rollback when the ledger confirms it, within MAX_ROLLBACKS."""
    if ledger_confirms is False:
        return Decision(
            "stop",
            code,
            f"training exited {code} (the spike exit code) but "
            "the spike ledger holds no new rollback request, so this is not a "
            "rollback request; treating it as a failure",
        )
    if budget.rollbacks_done >= budget.max_rollbacks:
        return Decision(
            "stop",
            code,
            f"rollback budget exhausted ({budget.rollbacks_done} "
            f"rollbacks, MAX_ROLLBACKS={budget.max_rollbacks})",
        )
    return Decision(
        "rollback", code, f"rollback {budget.rollbacks_done + 1}/{budget.max_rollbacks}"
    )


def _after_clean_exit(outcome: Outcome, budget: Budget) -> Decision:
    """Exit 0: finished only when the training said ``pretrain`` returned; an early exit
    resumes (for free while it saved progress, else within the restart budget)."""
    if outcome.ledger_confirms:
        return Decision(
            "stop",
            1,
            "training exited 0 but the spike ledger gained a rollback request during the "
            "attempt: a rollback is never a success; check --spike-exit-code, then run "
            "`megatron-ext skiplist --apply` and relaunch",
        )
    ended = outcome.ended
    if ended is None:
        return Decision(
            "finish",
            0,
            "training exited 0 (it recorded no end of its own: a training script that is not "
            "pretrain_gpt_ext.py or on megatron_ext.fork cannot tell the end of training from "
            "an early exit)",
        )
    if ended.complete:
        return Decision("finish", 0, "training finished successfully (reached its last iteration)")
    at = outcome.tracker[1]
    where = f"checkpoint {at}" if at is not None else "no checkpoint"
    stopped = f"training stopped early after {ended.reason}, with {where}"
    if outcome.progressed():
        return Decision("restart", 0, f"{stopped}; resuming", requeue=budget.requeue, charged=False)
    stopped += " and no progress since the last attempt"
    if budget.spent:
        return Decision(
            "stop",
            exit_codes.STOPPED_EARLY,
            f"{stopped}; restart budget exhausted ({budget.spent}); the training is NOT "
            "complete: resume by running or submitting the same command",
        )
    return Decision("restart", 0, f"{stopped}; {budget.next_restart}", requeue=budget.requeue)


def after_stop_signal(signal_name: str, code: int, budget: Budget, signal_number: int) -> Decision:
    """The launcher was signalled (preemption warning, scancel, Ctrl-C) and the training
    saved and exited with ``code``. SIGUSR1 under requeue mode asks for a requeue."""
    if code == exit_codes.FAILED_ON_RESULT_VALIDATION:
        return decide(Outcome(code, (), exit_codes.SPIKE_ROLLBACK), budget)
    if signal_name == "USR1" and budget.requeue:
        if budget.spent:
            reason = f"not requeueing: {budget.spent}; resubmit by hand to resume"
            return Decision("stop", 128 + signal_number, reason)
        return Decision("restart", 0, "time limit / preemption warning SIGUSR1", requeue=True)
    return Decision(
        "stop",
        128 + signal_number,
        f"stopped after SIG{signal_name}; rerun the same command to resume",
    )
