"""The supervisor: run training attempts, forwarding the stop signals (the training saves and
exits), and carry out the :mod:`.policy` decision on how each ended: finish, restart (here or
``scontrol requeue``), roll back (the spike hook, then relaunch) or stop.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from megatron_ext.common import attempt_end, exit_codes
from megatron_ext.common import run_lock as runlock
from megatron_ext.common.files import (
    ATTEMPT_END_FILE,
    UNCHARGED_REQUEUES_FILE,
    TrackerError,
    read_checkpoint_tracker,
)
from megatron_ext.common.io import atomic_write, read_jsonl
from megatron_ext.supervise import commands, knobs, policy, reports
from megatron_ext.supervise.commands import TrainingFacts
from megatron_ext.supervise.knobs import Config, KnobError
from megatron_ext.supervise.policy import Budget, Decision, Outcome

STOP_SIGNALS = ("USR1", "TERM", "INT", "HUP")
DIE_WITH_PARENT = ["setpriv", "--pdeathsig", "TERM", "--"] if shutil.which("setpriv") else []
NAMES = {"local": "single-node", "slurm": "sbatch"}


def log(scheduler: str, message: str) -> None:
    print(f"[megatron-ext {NAMES[scheduler]}] {message}", file=sys.stderr, flush=True)


def tracker(ckpt_dir: Path) -> int | None:
    """The newest checkpoint's iteration (None: none, or a damaged tracker, which the next
    attempt's start-up reports)."""
    try:
        return read_checkpoint_tracker(ckpt_dir)
    except TrackerError:
        return None


def uncharged_requeues(launch_state: Path) -> int:
    """Requeues after an early exit that saved progress, so far in this job: Slurm counts them
    in SLURM_RESTART_COUNT, but they are no failure to charge to MAX_RESTARTS."""
    try:
        text = (launch_state / UNCHARGED_REQUEUES_FILE).read_text().strip()
    except FileNotFoundError:
        return 0
    return int(text) if text.isdigit() else 0


@dataclass
class State:
    """What the supervisor remembers across attempts of one allocation."""

    attempt: int = 0
    inplace_restarts: int = 0
    rollbacks: int = 0
    stop_signal: str | None = None
    child: subprocess.Popen | None = None
    forwarded: bool = False
    slurm: dict[str, str] = field(default_factory=dict)


class Supervisor:
    def __init__(self, config: Config, cli_args: list[str], env: dict[str, str]) -> None:
        self.config = config
        self.cli_args = cli_args
        user_args = commands.user_args(config, cli_args)
        self.facts: TrainingFacts = commands.training_facts(user_args)
        knobs.resolve_connections(config, user_args)
        self.tracker_file = self.facts.tracker_file or config["TRACKER_FILE"]
        self.launch_state = Path(config["LAUNCH_STATE_DIR"])
        self.attempt_end_file = self.launch_state / ATTEMPT_END_FILE
        self.state = State(slurm={k: v for k, v in env.items() if k.startswith("SLURM_")})
        if config.scheduler == "slurm" and not self.state.slurm.get("SLURM_JOB_NODELIST"):
            raise KnobError(
                "SLURM_JOB_NODELIST is not set: submit with sbatch (or fake the "
                "SLURM_* variables for --dry-run)"
            )

    def say(self, message: str) -> None:
        log(self.config.scheduler, message)

    def attempt_tag(self, attempt: int) -> str:
        slurm = self.state.slurm
        return (
            f"{slurm.get('SLURM_JOB_ID', f'pid{os.getpid()}')}."
            f"r{slurm.get('SLURM_RESTART_COUNT', '0')}.a{attempt}"
        )

    def rc_dir(self, attempt: int) -> Path | None:
        torchrun = self.config["LAUNCHER"] == "torchrun"
        return self.launch_state / "exit_codes" / self.attempt_tag(attempt) if torchrun else None

    def hang_dir(self, attempt: int) -> Path:
        """Where this attempt's hang watchdogs meet and dump (fresh per attempt)."""
        return self.launch_state / "hangs" / self.attempt_tag(attempt)

    def command(self, attempt: int) -> list[str]:
        config = self.config
        env = commands.training_env(
            config, self.rc_dir(attempt), self.attempt_end_file, self.hang_dir(attempt)
        )
        worker = commands.worker_command(config, commands.train_args(config, self.cli_args))
        if config.scheduler == "slurm":
            return commands.slurm_command(config, env, worker, self.state.slurm, attempt)
        return commands.local_command(config, env, worker)

    def _on_signal(self, number: int, _frame: object) -> None:
        name = signal.Signals(number).name.removeprefix("SIG")
        if self.state.stop_signal is None:
            self.state.stop_signal = name
            self.say(f"received SIG{name}: asking the training to save a checkpoint and exit")
        else:
            self.say(
                f"received SIG{name} (already stopping after "
                f"SIG{self.state.stop_signal}); still waiting"
            )
        self._forward()

    def _forward(self) -> None:
        """Ask the running training to save and exit (once per attempt)."""
        child = self.state.child
        if child is None or self.state.forwarded:
            return
        self.state.forwarded = True
        if self.config.scheduler == "local":
            child.send_signal(signal.SIGTERM)
            return
        # SIGTERM to srun makes it SIGKILL its tasks mid-save; scancel signals every process
        # of the job's steps instead (torchrun forwards it and waits for the save).
        job = self.state.slurm.get("SLURM_JOB_ID")
        if job and shutil.which("scancel"):
            self.say(f"+ {commands.quote(['scancel', '--signal=TERM', job])}")
            subprocess.run(["scancel", "--signal=TERM", job], check=False)
        else:
            self.say("ERROR: scancel or SLURM_JOB_ID missing: cannot ask the training to save")

    def run_attempt(self, attempt: int) -> Outcome:
        rc_dir = self.rc_dir(attempt)
        if rc_dir is not None:
            shutil.rmtree(rc_dir, ignore_errors=True)
            rc_dir.mkdir(parents=True)
        before = self._rollback_requests()
        shutil.rmtree(self.hang_dir(attempt), ignore_errors=True)
        self.attempt_end_file.unlink(missing_ok=True)
        tracker_before = tracker(self.config.ckpt_dir)
        command = self.command(attempt)
        self.say(f"attempt {attempt}: launching training (checkpoints: {self.config.ckpt_dir})")
        print(f"+ {commands.quote(command)}", file=sys.stderr, flush=True)
        self.state.forwarded = False
        # Its launcher gets SIGTERM when the supervisor dies, even by SIGKILL (the training
        # saves and exits rather than running on unnoticed).
        self.state.child = subprocess.Popen([*DIE_WITH_PARENT, *command])
        if self.state.stop_signal is not None:  # a signal raced with the start
            self._forward()
        launcher_rc = self.state.child.wait()
        self.state.child = None
        if launcher_rc < 0:  # killed by a signal: report it the way a shell would
            launcher_rc = 128 - launcher_rc
        codes, workers = self._rank_codes(rc_dir)
        after = self._rollback_requests()
        hang = None
        if exit_codes.HUNG in codes:
            where = (self.hang_dir(attempt), self.config.ckpt_dir, self.attempt_tag(attempt))
            hang = reports.hang(*where, attempt, codes, self.say)
        outcome = Outcome(
            launcher_rc,
            codes,
            self.facts.spike_exit_code,
            None if after is None else after > (before or 0),
            workers,
            attempt_end.read(self.attempt_end_file),
            (tracker_before, tracker(self.config.ckpt_dir)),
            *(hang or (None, False)),
        )
        if launcher_rc != 0 and codes:
            # Which rank on which node ended how: a partial failure names its node here.
            exits = ", ".join(f"{w} exited {c}" for w, c in zip(workers, codes))
            self.say(f"attempt {attempt}: {exits}")
        if outcome.effective() != launcher_rc:
            self.say(
                f"launcher exited {launcher_rc}; training workers reported exit "
                f"code {outcome.effective()}"
            )
        return outcome

    @staticmethod
    def _rank_codes(rc_dir: Path | None) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """Each rank's exit code, in rank order, and "rank R on HOST" for each."""
        if rc_dir is None or not rc_dir.is_dir():
            return (), ()
        found: dict[int, tuple[int, str]] = {}
        for path in rc_dir.glob("rank-*.rc"):
            rank, words = path.stem.removeprefix("rank-"), path.read_text().split()
            if rank.isdigit() and words and words[0].isdigit():
                host = f" on {words[1]}" if len(words) > 1 else ""
                found[int(rank)] = (int(words[0]), f"rank {rank}{host}")
        shutil.rmtree(rc_dir, ignore_errors=True)
        ordered = [found[rank] for rank in sorted(found)]
        return tuple(c for c, _ in ordered), tuple(w for _, w in ordered)

    def _rollback_requests(self) -> int | None:
        """Rollback requests in the spike ledger so far; None when the run keeps none."""
        ledger = self.facts.ledger
        if ledger is None:
            return None
        if not ledger.is_file():
            return 0
        return sum(e.get("kind") == "rollback" for e in read_jsonl(ledger, warn=False).records)

    def budget(self) -> Budget:
        config = self.config
        restarts = int(self.state.slurm.get("SLURM_RESTART_COUNT") or 0)
        return Budget(
            max(0, restarts - uncharged_requeues(self.launch_state)) + self.state.inplace_restarts,
            config.number("MAX_RESTARTS"),
            self.state.rollbacks,
            config.number("MAX_ROLLBACKS"),
            config["RESTART_MODE"] == "requeue",
        )

    def take_run_lock(self) -> None:
        """Hold CKPT_DIR for the whole job (trainings and the spike hook inherit the lease
        through the environment); a live holder elsewhere stops the job before it starts."""
        config = self.config
        force = knobs.truthy(config["FORCE_RUN_LOCK"])
        try:
            lease = runlock.acquire(config.ckpt_dir, "supervisor", "supervise", force)
        except runlock.RunLockHeld as exc:
            raise KnobError(str(exc).removeprefix("megatron-ext: ")) from None
        os.environ[runlock.TOKEN_ENV] = lease.holder.token
        atexit.register(lease.release)

        def lost(message: str) -> None:
            self.say(f"ERROR: {message}; stopping (the training stops with its supervisor)")
            os._exit(2)

        lease.watch(lost)

    def main(self) -> NoReturn:
        config = self.config
        try:
            self.take_run_lock()
            for path in (config.ckpt_dir, self.launch_state, Path(self.tracker_file).parent):
                path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise KnobError(
                f"cannot create the run's directories ({exc}): CKPT_DIR, LAUNCH_STATE_DIR and "
                "the folder of TRACKER_FILE must be directories this user can write"
            ) from None
        for name in STOP_SIGNALS:
            signal.signal(getattr(signal, f"SIG{name}"), self._on_signal)
        while True:
            self.state.attempt += 1
            outcome = self.run_attempt(self.state.attempt)
            code = outcome.effective()
            if self.state.stop_signal is not None:
                name = self.state.stop_signal
                self.say(f"training stopped after SIG{name} (effective exit code {code})")
                decision = policy.after_stop_signal(
                    name, code, self.budget(), int(getattr(signal, f"SIG{name}"))
                )
            else:
                decision = policy.decide(outcome, self.budget())
            self.act(decision, code)

    def act(self, decision: Decision, code: int) -> None:
        """Carry out one decision; returns only to relaunch."""
        config = self.config
        if decision.action == "finish":
            self.say(decision.reason)
            sys.exit(0)
        if code == exit_codes.RESUME_TO_DISAMBIGUATE:
            self.say(
                "training exited 16 (EXIT_CODE_RESUME_TO_DISAMBIGUATE): Megatron's "
                "rerun state machine needs a restart from the last checkpoint to disambiguate "
                "a result"
            )
        if decision.action == "restart":
            if decision.requeue:
                if not decision.charged:
                    # Atomically: the requeue may kill the supervisor right after.
                    count = uncharged_requeues(self.launch_state) + 1
                    atomic_write(self.launch_state / UNCHARGED_REQUEUES_FILE, f"{count}\n")
                self.requeue(decision)
            self.state.inplace_restarts += decision.charged
            self.say(f"relaunching in place from the last checkpoint ({decision.reason})")
            return
        if decision.action == "rollback":
            self.rollback(decision)
            return
        if code == exit_codes.FAILED_ON_RESULT_VALIDATION:
            reports.validation_failure(
                Path(self.tracker_file), config.ckpt_dir, self.state.slurm, self.say
            )
        signalled = self.state.stop_signal is not None and decision.exit_code > 128
        self.say(decision.reason if signalled else f"ERROR: {decision.reason}")
        if code in (exit_codes.RESUME_TO_DISAMBIGUATE, exit_codes.KILLED) or signalled:
            self.say(
                f"resume from {config.ckpt_dir} by running or submitting the same command again"
            )
        sys.exit(decision.exit_code)

    def requeue(self, decision: Decision) -> NoReturn:
        job = self.state.slurm.get("SLURM_JOB_ID")
        if not job:
            self.say(
                f"cannot requeue ({decision.reason}): not inside a Slurm job (SLURM_JOB_ID unset)"
            )
        else:
            self.say(
                f"requeueing Slurm job {job} ({decision.reason}); it will resume "
                f"from {self.config.ckpt_dir}"
            )
            self.say(f"+ {commands.quote(['scontrol', 'requeue', job])}")
            if subprocess.run(["scontrol", "requeue", job], check=False).returncode == 0:
                sys.exit(0)
            self.say(f"scontrol requeue {job} failed")
        code = decision.exit_code or 128 + signal.SIGUSR1
        self.say(
            f"ERROR: giving up with exit {code}: resubmit the job to resume from "
            f"{self.config.ckpt_dir}"
        )
        sys.exit(code)

    def rollback(self, decision: Decision) -> None:
        config, code = self.config, decision.exit_code
        self.say(
            f"training exited {code}: megatron-ext detected a loss spike and requests a rollback"
        )
        hook = config["MEGATRON_EXT_ON_SPIKE"]
        if not hook and not self.facts.signals_dir:
            self.say(
                f"ERROR: MEGATRON_EXT_ON_SPIKE is not set and the run has no "
                f"--signals-dir, so there is no rollback hook to run; stopping with exit {code}. "
                "Train with --signals-dir DIR --spike-detect (default hook: megatron-ext "
                "skiplist --apply) or set MEGATRON_EXT_ON_SPIKE to your own command."
            )
            sys.exit(code)
        self.state.rollbacks += 1
        env = {
            **os.environ,
            "MEGATRON_EXT_CKPT_DIR": str(config.ckpt_dir),
            "MEGATRON_EXT_SIGNALS_DIR": self.facts.signals_dir or "",
            "MEGATRON_EXT_TRACKER_FILE": self.tracker_file,
            "MEGATRON_EXT_ROLLBACK": str(self.state.rollbacks),
            "MEGATRON_EXT_MAX_ROLLBACKS": config["MAX_ROLLBACKS"],
            "MEGATRON_EXT_TRAIN_EXIT_CODE": str(code),
        }
        command = ["bash", "-c", hook]
        if not hook:
            command = [sys.executable, "-m", "megatron_ext.cli", "skiplist", "--apply"]
            command += ["--ckpt-dir", str(config.ckpt_dir)]
            command += ["--signals-dir", self.facts.signals_dir or ""]
            command += ["--tracker-file", self.tracker_file]
            command += ["--ledger", str(self.facts.ledger)] if self.facts.ledger else []
            command += config.words("SKIPLIST_ARGS")
        self.say(f"running spike hook ({decision.reason}): {commands.quote(command)}")
        hook_rc = subprocess.run(command, env=env, stdin=subprocess.DEVNULL).returncode
        if hook_rc != 0:
            self.say(f"ERROR: spike hook failed with exit {hook_rc}; stopping with exit {code}")
            sys.exit(code)
        self.say("spike hook done; relaunching from the last checkpoint")
