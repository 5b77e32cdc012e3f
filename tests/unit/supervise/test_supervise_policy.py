"""The supervisor's policy as data: the effective exit code, every row of the exit-code table,
--spike-exit-code honoured, the spike ledger consulted, and training-argument facts."""

from __future__ import annotations

import shlex
import socket
import subprocess
import time
from pathlib import Path
from string import Template

import pytest

from megatron_ext.common.attempt_end import AttemptEnd
from megatron_ext.supervise.commands import RANK_WRAPPER, quote
from megatron_ext.supervise.policy import Budget, Outcome, after_stop_signal, decide
from megatron_ext.supervise.runner import Supervisor


@pytest.mark.parametrize(
    ("launcher_rc", "rank_codes", "expected"),
    [
        (0, [0, 0], 0),
        (1, [16, 16], 16),
        (1, [16, 143], 16),  # the slower rank was SIGTERMed by torchrun
        (1, [1, 17, 143], 17),  # 17 beats everything
        (1, [42, 16], 42),
        (1, [0, 3, 143], 3),
        (1, [143, 143], 1),  # only signal deaths: keep the launcher's code
        (1, [], 1),  # no worker files (e.g. rendezvous failure)
        (137, [0, 0], 137),
        (1, [1, 137], 137),  # a SIGKILLed worker outranks its peer's collateral failure
        (1, [137, 143], 137),
        (1, [16, 137], 16),  # an explicit request still wins
        (1, [42, 137], 42),
    ],
)
def test_effective_rc(launcher_rc: int, rank_codes: list[int], expected: int):
    assert Outcome(launcher_rc, tuple(rank_codes), 42).effective() == expected


def test_quote_round_trips():
    words = ["plain", "a b", "it's", "", "$HOME", 'x="y"', "--opt=1,2", "*"]
    assert shlex.split(quote(words)) == words


def _budget(**overrides: object) -> Budget:
    return Budget(
        **{
            "restarts_done": 0,
            "max_restarts": 3,
            "rollbacks_done": 0,
            "max_rollbacks": 2,
            "requeue": False,
            **overrides,
        }
    )


COMPLETE = AttemptEnd(True, "pretrain returned")
EARLY = AttemptEnd(False, "--exit-duration-in-mins 1")


@pytest.mark.parametrize(
    "outcome, budget, action, exit_code, reason",
    [
        (Outcome(0, (0, 0), 42, ended=COMPLETE), _budget(), "finish", 0, "finished"),
        (Outcome(0, (0, 0), 42), _budget(), "finish", 0, "recorded no end of its own"),
        # torchrun got the stop signal too (exits 1) while every worker saved and exited 0.
        (Outcome(1, (0, 0), 42, ended=COMPLETE), _budget(), "finish", 0, "finished"),
        # Stopped early (exit duration, exit interval, a TERM to the workers): never finished.
        (Outcome(0, (0,), 42, ended=EARLY, tracker=(5, 9)), _budget(), "restart", 0, "resuming"),
        (Outcome(1, (0, 0), 42, ended=EARLY, tracker=(None, 9)), _budget(), "restart", 0, "early"),
        (Outcome(0, (0,), 42, ended=EARLY, tracker=(9, 9)), _budget(), "restart", 0, "restart 1/3"),
        (Outcome(0, (0,), 42, ended=EARLY), _budget(restarts_done=3), "stop", 75, "NOT complete"),
        (Outcome(1, (16, 16), 42), _budget(), "restart", 16, "restart 1/3"),
        (Outcome(1, (16,), 42), _budget(restarts_done=3), "stop", 16, "MAX_RESTARTS=3"),
        (Outcome(1, (17, 143), 42), _budget(), "stop", 17, "reproducible or hardware-suspect"),
        (Outcome(1, (42, 42), 42, ledger_confirms=True), _budget(), "rollback", 42, "rollback 1/2"),
        (Outcome(1, (42,), 42), _budget(), "rollback", 42, "rollback 1/2"),  # no ledger kept
        (Outcome(1, (42,), 42, ledger_confirms=False), _budget(), "stop", 42, "no new rollback"),
        (Outcome(1, (42,), 42, True), _budget(rollbacks_done=2), "stop", 42, "MAX_ROLLBACKS=2"),
        (Outcome(1, (3, 143), 42), _budget(), "stop", 3, "training failed with exit code 3"),
        # --spike-exit-code 55: 55 is the rollback request, 42 is an ordinary failure.
        (Outcome(1, (55, 55), 55, True), _budget(), "rollback", 55, "rollback 1/2"),
        (Outcome(1, (42, 42), 55), _budget(), "stop", 42, "training failed with exit code 42"),
    ],
)
def test_every_row_of_the_exit_code_table(outcome, budget, action, exit_code, reason) -> None:
    decision = decide(outcome, budget)
    assert (decision.action, decision.exit_code) == (action, exit_code)
    assert reason in decision.reason
    assert decision.requeue is False


def test_restart_requeues_only_in_requeue_mode() -> None:
    assert decide(Outcome(1, (16,), 42), _budget(requeue=True)).requeue


def test_an_early_exit_with_progress_is_not_charged_and_requeues_under_requeue() -> None:
    progressed = Outcome(0, (0,), 42, ended=EARLY, tracker=(5, 9))
    decision = decide(progressed, _budget(requeue=True, restarts_done=3))
    assert (decision.action, decision.requeue, decision.charged) == ("restart", True, False)
    stalled = decide(Outcome(0, (0,), 42, ended=EARLY, tracker=(9, 9)), _budget())
    assert stalled.charged


@pytest.mark.parametrize(
    "name, number, requeue, restarts, action, code",
    [
        ("USR1", 10, True, 0, "restart", 0),  # preemption warning: save, requeue
        ("USR1", 10, True, 3, "stop", 138),  # budget spent: no requeue
        ("USR1", 10, False, 0, "stop", 138),  # single node: stop, rerun to resume
        ("TERM", 15, True, 0, "stop", 143),  # scancel: save and stop, never requeue
    ],
)
def test_after_a_stop_signal(name, number, requeue, restarts, action, code) -> None:
    decision = after_stop_signal(name, 0, _budget(requeue=requeue, restarts_done=restarts), number)
    assert (decision.action, decision.exit_code) == (action, code)


NODES = ("rank 0 on n1", "rank 1 on n2")
# What torchrun hands its worker: every argument through Template.safe_substitute (its
# ${local_rank} macro, torch.distributed.elastic.utils.api.macros.substitute).
AS_TORCHRUN_PASSES_IT = Template(RANK_WRAPPER).safe_substitute(local_rank="0")


@pytest.mark.parametrize(
    "outcome, budget, action, exit_code, requeue",
    [
        # One node's worker SIGKILLed, its peer failed in the collective: requeue.
        (Outcome(1, (1, 137), 42, workers=NODES), _budget(requeue=True), "restart", 137, True),
        (Outcome(1, (143, 137), 42, workers=NODES), _budget(), "restart", 137, False),
        (Outcome(1, (1, 137), 42, workers=NODES), _budget(restarts_done=3), "stop", 137, False),
    ],
)
def test_a_worker_killed_by_sigkill_restarts_within_the_budget(
    outcome, budget, action, exit_code, requeue
) -> None:
    decision = decide(outcome, budget)
    assert (decision.action, decision.exit_code, decision.requeue) == (action, exit_code, requeue)
    assert decision.reason.startswith("rank 1 on n2 killed by SIGKILL")
    assert ("MAX_RESTARTS=3" in decision.reason) == (action == "stop")


def test_a_sigkilled_launcher_is_not_a_killed_worker() -> None:
    """137 from srun/torchrun itself (no worker says so) is not the rule: stop with it."""
    decision = decide(Outcome(137, (0, 0), 42), _budget())
    assert (decision.action, decision.exit_code) == ("stop", 137)


def test_rank_wrapper_records_a_sigkill_and_the_node(tmp_path: Path) -> None:
    """The real wrapper, around a worker that is SIGKILLed: it survives and records 137 and
    the node it runs on (the kernel's name, not an inherited $HOSTNAME)."""
    result = subprocess.run(
        ["bash", "-c", AS_TORCHRUN_PASSES_IT, "megatron-ext-rank", "bash", "-c", "kill -9 $$"],
        env={
            "RANK": "3",
            "MEGATRON_EXT_EXIT_CODE_DIR": str(tmp_path),
            "PATH": "/usr/bin:/bin",
            "HOSTNAME": "the-batch-host",  # Slurm exports the batch host's; srun passes it on
        },
        timeout=30,
    )
    assert result.returncode == 137
    assert (tmp_path / "rank-3.rc").read_text() == f"137 {socket.gethostname()}\n"


def test_rank_wrapper_ends_what_a_killed_worker_left_holding_the_output(tmp_path: Path) -> None:
    """A worker SIGKILLed with a SIGTERM-deaf child (as the checkpoint writer's Manager is)
    that holds stdout: the wrapper, a group leader as under torchrun, kills the orphan, so
    whoever reads the output (slurmstepd, for srun) sees it end with the wrapper."""
    worker = (
        f"(trap '' TERM; echo $BASHPID >{tmp_path}/orphan; exec sleep 300) & sleep 0.5; kill -9 $$"
    )
    proc = subprocess.Popen(
        ["bash", "-c", AS_TORCHRUN_PASSES_IT, "megatron-ext-rank", "bash", "-c", worker],
        env={"RANK": "0", "MEGATRON_EXT_EXIT_CODE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"},
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    proc.communicate(timeout=60)  # EOF: nothing holds the output any more (a hang guard)
    assert proc.returncode == 137
    orphan = int((tmp_path / "orphan").read_text())
    deadline = time.monotonic() + 20  # SIGKILL is delivered asynchronously: a loaded machine
    while Path(f"/proc/{orphan}").exists() and "Z" not in _state(orphan):
        assert time.monotonic() < deadline, "orphan still runs"
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:  # gone between the check and the read
        return "Z"


def test_rank_codes_are_read_in_rank_order_with_their_nodes(tmp_path: Path) -> None:
    for rank, text in {2: "0 n1", 10: "137 n6", 1: "1 n1", 0: "16"}.items():
        (tmp_path / f"rank-{rank}.rc").write_text(text + "\n")
    (tmp_path / "rank-5.rc").write_text("")  # torn: the wrapper died while writing
    codes, workers = Supervisor._rank_codes(tmp_path)
    assert codes == (16, 1, 0, 137)
    assert workers == ("rank 0", "rank 1 on n1", "rank 2 on n1", "rank 10 on n6")
    assert not tmp_path.exists()  # consumed


def test_a_hang_restarts_and_a_repeated_hang_stops() -> None:
    hang = "hang at iteration 12: rank 1 made no progress (stuck at x.py, line 3, in f)"
    first = Outcome(1, (143, 43), 42, hang=hang)
    assert first.effective() == 43 and Outcome(1, (1, 43, 137), 42).effective() == 43
    decision = decide(first, _budget())
    assert decision.action == "restart" and decision.reason.startswith(hang)
    again = decide(Outcome(1, (143, 43), 42, hang=hang, hang_repeats=True), _budget())
    assert (again.action, again.exit_code) == ("stop", 43) and "same hang" in again.reason
    spent = decide(first, _budget(restarts_done=3))
    assert (spent.action, spent.exit_code) == ("stop", 43)
