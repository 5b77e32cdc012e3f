"""What the launcher does after a training attempt ends: the exit-code policy, as data.

Pure functions (no I/O): from the launcher's exit status, what each rank reported, the spike
ledger and the budgets, :func:`decide` returns one :class:`Decision`. The runner carries it
out; tests exercise every row without starting anything.

==========  ===========================================  =====================================
code        meaning                                      action
==========  ===========================================  =====================================
0           training finished: the training recorded     exit 0
            that ``pretrain`` returned
0           stopped early (--exit-duration-in-mins,      relaunch or requeue, uncharged while
            --exit-interval, a stop signal to the        the checkpoint advanced (else
            workers): saved, then exit 0                 MAX_RESTARTS); never "finished"
16          EXIT_CODE_RESUME_TO_DISAMBIGUATE (Megatron)  restart from the last checkpoint:
                                                         requeue or relaunch (MAX_RESTARTS)
17          EXIT_CODE_FAILED_ON_RESULT_VALIDATION        stop with 17, report the tracker file
43          megatron-ext's hang watchdog: a rank made    restart from the last checkpoint
            no progress within its bound; every rank     (MAX_RESTARTS); stop with 43 when
            dumped its stacks (hang report)              it hung at the same iteration and
                                                         place as the previous attempt
spike code  megatron-ext rollback request (default 42,   run the spike hook (plan + apply),
            --spike-exit-code), confirmed by the ledger  relaunch (MAX_ROLLBACKS)
137         a worker killed by SIGKILL while its rank    restart from the last checkpoint:
            wrapper lived: the out-of-memory killer,     requeue or relaunch (MAX_RESTARTS)
            an operator, a failing node
other       a crash, or a spike code the ledger does     stop with that code
            not confirm
==========  ===========================================  =====================================

Why 137 restarts: torchrun and Slurm end a rank's wrapper together with its worker (SIGKILL to
the process group, or every process of the step), so a worker that died of SIGKILL while its
wrapper lived to record it was killed from outside the job. Its peers then fail too (a
collective loses its partner: exit 1, or 143 when torchrun or srun stops them); those codes
are consequences, so a kill outranks them. A crash that happens to coincide with one is
restarted too and fails again, bounded by MAX_RESTARTS.
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
    # Who reported each of rank_codes ("rank 1 on n2"), for log lines; may be empty.
    workers: tuple[str, ...] = ()
    # How the training said it ended (None: it did not say: a crash, or a script of the
    # user's own), and the checkpoint tracker before and after the attempt.
    ended: AttemptEnd | None = None
    tracker: tuple[int | None, int | None] = (None, None)
    # The hang watchdog's finding (exit 43): who hung where, and whether the previous
    # attempt hung at the same iteration and place.
    hang: str | None = None
    hang_repeats: bool = False

    def progressed(self) -> bool:
        """Whether the attempt left a newer checkpoint than it started from."""
        before, after = self.tracker
        return after is not None and (before is None or after > before)

    def effective(self) -> int:
        """The code that matters: 17, then the spike code, then 16, then a hang (the
        watchdog's 43: its peers' failures follow from it), then a worker killed by SIGKILL,
        then the first other non-zero code a worker exited with (not a signal death), else
        the launcher's."""
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


@dataclass(frozen=True)
class Decision:
    action: Action
    exit_code: int  # the launcher's exit status when it stops (0 after a requeue)
    reason: str
    requeue: bool = False  # for "restart": scontrol requeue instead of relaunching here
    charged: bool = True  # for "restart": counts against MAX_RESTARTS


def decide(outcome: Outcome, budget: Budget) -> Decision:
    """The row of the table above that applies to ``outcome``."""
    code = outcome.effective()
    if code == 0 and outcome.ledger_confirms:
        return Decision(
            "stop",
            1,
            "training exited 0 but the spike ledger gained a rollback request during the "
            "attempt: a rollback is never a success; check --spike-exit-code, then run "
            "`megatron-ext skiplist --apply` and relaunch",
        )
    if code == 0:
        return _after_clean_exit(outcome, budget)
    killed = outcome.killed() if code == exit_codes.KILLED else []
    if code == exit_codes.HUNG and outcome.hang_repeats:
        return Decision(
            "stop",
            code,
            f"{outcome.hang}: the same hang as the previous attempt (same iteration, same "
            "place), so a restart would hang again; read the stacks in the hang report",
        )
    if code in (exit_codes.RESUME_TO_DISAMBIGUATE, exit_codes.HUNG) or killed:
        cause = ""
        if killed:
            cause = (
                f"{', '.join(killed)} killed by SIGKILL (the out-of-memory killer, an operator "
                "or a failing node; see the node's kernel log); "
            )
        elif code == exit_codes.HUNG:
            cause = f"{outcome.hang or 'a rank made no progress'}; "
        if budget.restarts_done >= budget.max_restarts:
            return Decision(
                "stop",
                code,
                f"{cause}restart budget exhausted ({budget.restarts_done} "
                f"restarts so far, MAX_RESTARTS={budget.max_restarts}); giving up",
            )
        return Decision(
            "restart",
            code,
            f"{cause}restart {budget.restarts_done + 1}/{budget.max_restarts}",
            requeue=budget.requeue,
        )
    if code == exit_codes.FAILED_ON_RESULT_VALIDATION:
        return Decision(
            "stop",
            code,
            "a result validation failed in Megatron's rerun state "
            "machine and the failure was reproducible or hardware-suspect",
        )
    if code == outcome.spike_code:
        if outcome.ledger_confirms is False:
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
    return Decision("stop", code, f"training failed with exit code {code}; stopping")


def _after_clean_exit(outcome: Outcome, budget: Budget) -> Decision:
    """Exit 0: finished only when the training said ``pretrain`` returned; an early exit
    resumes (for free while it saved progress, else within the restart budget)."""
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
    if budget.restarts_done >= budget.max_restarts:
        return Decision(
            "stop",
            exit_codes.STOPPED_EARLY,
            f"{stopped} and no progress since the last attempt; restart budget exhausted "
            f"({budget.restarts_done} restarts so far, MAX_RESTARTS={budget.max_restarts}); "
            "the training is NOT complete: resume by running or submitting the same command",
        )
    return Decision(
        "restart",
        0,
        f"{stopped} and no progress since the last attempt; restart "
        f"{budget.restarts_done + 1}/{budget.max_restarts}",
        requeue=budget.requeue,
    )


def after_stop_signal(signal_name: str, code: int, budget: Budget, signal_number: int) -> Decision:
    """The launcher was signalled (preemption warning, scancel, Ctrl-C) and the training
    saved and exited with ``code``. SIGUSR1 under requeue mode asks for a requeue."""
    if code == exit_codes.FAILED_ON_RESULT_VALIDATION:
        return decide(Outcome(code, (), exit_codes.SPIKE_ROLLBACK), budget)
    if signal_name == "USR1" and budget.requeue:
        if budget.restarts_done >= budget.max_restarts:
            return Decision(
                "stop",
                128 + signal_number,
                f"not requeueing: "
                f"{budget.restarts_done} restarts so far, MAX_RESTARTS="
                f"{budget.max_restarts}; resubmit by hand to resume",
            )
        return Decision("restart", 0, "time limit / preemption warning SIGUSR1", requeue=True)
    return Decision(
        "stop",
        128 + signal_number,
        f"stopped after SIG{signal_name}; rerun the same command to resume",
    )
