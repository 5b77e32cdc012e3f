"""``megatron-ext supervise``: the command both launch scripts exec.

    megatron-ext supervise --scheduler local|slurm [--dry-run] [--help] [TRAINING ARGS...]

Configuration comes from the environment (the knobs in :mod:`.knobs`, listed by ``--help``
with their defaults, and the exit-code table); arguments other than ``--dry-run``/``--help``
(and everything after ``--``) are appended to the training arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from megatron_ext.supervise import commands, knobs
from megatron_ext.supervise.knobs import KnobError
from megatron_ext.supervise.runner import NAMES, Supervisor, log

EXIT_CODES = """Exit codes of the training and what the supervisor does (supervise/policy.py):
   0  finished: the training recorded that pretrain returned -> exit 0
   0  stopped early (--exit-duration-in-mins, --exit-interval, a stop signal to the workers)
      -> relaunch or requeue, not charged to MAX_RESTARTS while the checkpoint advanced;
      without progress at most MAX_RESTARTS, then exit 75 (not complete)
  16  EXIT_CODE_RESUME_TO_DISAMBIGUATE         -> restart from the last checkpoint
      (RESTART_MODE: requeue or relaunch in place), at most MAX_RESTARTS; then exit 16
  17  EXIT_CODE_FAILED_ON_RESULT_VALIDATION    -> stop, print the tracker file and the
      nodes it names; exit 17 (never retried blindly)
  42  megatron-ext rollback request (--spike-exit-code; the spike ledger must confirm it;
      also a NaN/Inf loss or grad norm, in every --rerun-mode) -> run MEGATRON_EXT_ON_SPIKE
      (default: megatron-ext skiplist --apply, which rolls back further when the failure
      came back) and relaunch, at most MAX_ROLLBACKS; no hook, hook failure or budget spent
      -> exit 42
 137  a worker killed by SIGKILL (out-of-memory killer, operator, failing node; the log
      names its rank and node) -> restart like 16, at most MAX_RESTARTS; then exit 137
  other  a crash                               -> stop with that code
The supervisor also exits 2 on a configuration error and 128+N after stopping on signal N
(SIGUSR1 with RESTART_MODE=requeue: requeue and exit 0 while the restart budget lasts)."""


def build_parser(scheduler: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog=f"megatron-ext supervise --scheduler {scheduler}",
        add_help=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__,
        epilog="Knobs (environment variables) [default]:\n"
        + knobs.describe(scheduler)
        + "\n\n"
        + EXIT_CODES,
    )


def _scheduler(argv: list[str]) -> tuple[str, list[str]]:
    """``--scheduler X`` or ``--scheduler=X`` first (default: local), and the other arguments."""
    if argv[:1] == ["--scheduler"]:
        return (argv[1:2] or [""])[0], argv[2:]
    if argv[:1] and argv[0].startswith("--scheduler="):
        return argv[0].partition("=")[2], argv[1:]
    return "local", argv


def main(argv: list[str] | None = None) -> int:
    scheduler, argv = _scheduler(sys.argv[1:] if argv is None else list(argv))
    if scheduler not in NAMES:
        print(
            f"megatron-ext supervise: --scheduler must be local or slurm, got {scheduler!r}",
            file=sys.stderr,
        )
        return 2
    dry_run, cli_args = False, []
    for index, arg in enumerate(argv):
        if arg == "--":
            cli_args += argv[index + 1 :]
            break
        if arg == "--dry-run":
            dry_run = True
        elif arg in ("-h", "--help"):
            build_parser(scheduler).print_help()
            return 0
        else:
            cli_args.append(arg)
    env = dict(os.environ)
    root = Path(env.get("MEGATRON_EXT_ROOT") or Path(__file__).resolve().parents[2])
    try:
        config = knobs.load(env, scheduler, root, Path.cwd())
        dry_run = dry_run or knobs.truthy(config["DRY_RUN"])
        supervisor = Supervisor(config, cli_args, env)
        if dry_run:
            print(f"+ {commands.quote(supervisor.command(1))}", flush=True)
            return 0
        if not Path(config["TRAIN_SCRIPT"]).is_file():
            raise KnobError(
                f"TRAIN_SCRIPT {config['TRAIN_SCRIPT']} does not exist; set "
                "TRAIN_SCRIPT or MEGATRON_EXT_ROOT"
            )
        supervisor.main()
    except KnobError as exc:
        log(scheduler, f"ERROR: {exc}")
        return exc.exit_code
    return 0
