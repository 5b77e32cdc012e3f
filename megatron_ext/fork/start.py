"""How ``pretrain_gpt_ext.py`` and a script of the user's own (:class:`megatron_ext.fork.Overlay`)
start and end: version check, skip lists, verified registry and fixes, then the installed
version's runner; rank 0 records how it ended and a refusal ends the rank without a traceback.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
import traceback

from megatron_ext.loop.step import Step


def default_transformer_impl(argv: list[str]) -> list[str]:
    """``--transformer-impl local`` (announced) when Transformer Engine is absent and no
    implementation was chosen: Megatron's default cannot start without TE."""
    if "--transformer-impl" in argv or importlib.util.find_spec("transformer_engine"):
        return argv
    print("megatron-ext: Transformer Engine not importable; using --transformer-impl local")
    return [*argv, "--transformer-impl", "local"]


def megatron_refusal(exc: AssertionError) -> str | None:
    """An assertion of Megatron's ``validate_args`` as a one-line refusal; None for any other
    assertion (a bug, which keeps its traceback)."""
    frames = traceback.extract_tb(exc.__traceback__)
    path = "megatron/training/arguments.py"
    if not any(f.name == "validate_args" and f.filename.endswith(path) for f in frames):
        return None
    message = " ".join(str(exc).split()) or "an assertion without a message"
    return (
        f"megatron-ext: Megatron refuses these flags: {message} (its validate_args); change the "
        "flags it names (docs/layouts.md lists what the overlay runs at)"
    )


def rank() -> int:
    """This process's global rank before torch.distributed exists (torchrun, then Slurm)."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def prepare_skips(argv: list[str]) -> list[str]:
    """Megatron's argv with one flat ``--iterations-to-skip``: the skip flags and the list
    persisted in ``--load``, printed once; first an interrupted ``skiplist --apply`` there is
    finished (rank 0, the run's one writer) and a pending rollback request applied."""
    from megatron_ext.common.records.skip_ranges import load_dir, resolve_argv
    from megatron_ext.common.run_lock import RunLockHeld, held
    from megatron_ext.incidents.transaction import journal_path, settle_at_startup

    load = load_dir(argv)
    if load and rank() == 0 and journal_path(load).exists():
        # Finishing the apply changes the checkpoint directory: only as its one writer.
        try:
            with held(
                load,
                "training",
                "finishing an interrupted `skiplist --apply`",
                "--force-run-lock" in argv,
            ):
                journal = settle_at_startup(load, 0)
        except RunLockHeld as exc:
            raise SystemExit(str(exc)) from None
    else:
        journal = settle_at_startup(load, rank())
    if journal is not None:
        print(
            f"megatron-ext: finished the interrupted `skiplist --apply` of incident "
            f"{journal.incident:03d} (rolled back to {journal.rollback_to})",
            flush=True,
        )
    from megatron_ext.incidents.pending import apply_at_startup

    apply_at_startup(argv, rank())
    try:
        megatron_argv, sources = resolve_argv(argv)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"megatron-ext: {exc}") from None
    if (sources.union() or sources.notes) and rank() == 0:
        print(sources.describe(), flush=True)
    return megatron_argv


def _require_cuda(script: str | None) -> None:
    """Refuse early, with the CPU command for ``script`` (None: ``pretrain_gpt_ext.py``),
    instead of Megatron's bare "requires CUDA" assert (the CPU runner marks ``torch.cuda``)."""
    import torch

    if torch.cuda.is_available() or getattr(torch.cuda, "_megatron_ext_cpu_harness", False):
        return
    option = "" if script is None else f" --script {script}"
    raise SystemExit(
        "megatron-ext: no CUDA device: Megatron requires CUDA. To train on CPU (a small model "
        "on your own data, through the package's CPU runner), run the same flags with "
        f"`megatron-ext train --cpu{option} [--nproc-per-node N] -- <flags>`; "
        "`megatron-ext demo` shows it end to end."
    )


def main(argv: list[str], step: Step | None = None, program_start: float | None = None) -> None:
    """:func:`train`; a refusal ends the rank with its message and exit code, and a failed rank
    ends its helper processes first."""
    from megatron_ext.common.errors import exit_on_error
    from megatron_ext.common.process_exit import ending_children_on_failure

    ending_children_on_failure(lambda: exit_on_error(lambda: train(argv, step, program_start)))


def train(argv: list[str], step: Step | None = None, program_start: float | None = None) -> None:
    """Parse the arguments, install patches and run ``pretrain`` with ``step`` (None: the
    overlay's GPT step). ``program_start``: when the script started, for Megatron's timers."""
    wants_help = "-h" in argv or "--help" in argv
    if wants_help:  # help is not training: keep optional-dependency import warnings out of it
        from megatron_ext.common.quiet import silence_import_noise

        silence_import_noise()
    else:
        _require_cuda(None if step is None else sys.argv[0])
        argv = default_transformer_impl(argv)
        from megatron_ext.common import cuda_connections

        # Before Megatron's parser, whose FSDP check is an assertion traceback.
        cuda_connections.check(argv, os.environ)
    from megatron_ext.registry import patching

    # Before any Megatron import: an unsupported version is a refusal, not an ImportError.
    patching.check_version()
    sys.argv = [sys.argv[0], *prepare_skips(argv)]

    from megatron.training import set_startup_timestamps

    from megatron_ext.common import attempt_end
    from megatron_ext.common.errors import StartupError
    from megatron_ext.loop import entry
    from megatron_ext.registry import table as registry

    if program_start is not None:
        set_startup_timestamps(program_start=program_start, main_entry=time.time())
    registry.verify_all()
    for fix in registry.BUGFIXES:
        fix.apply()
    try:
        entry.run(step)
    except AssertionError as exc:
        refusal = megatron_refusal(exc)
        if refusal is None:
            raise
        raise StartupError(refusal) from None
    except SystemExit as exc:
        # Megatron's early exits save, then sys.exit(0); rank 0 tells the supervisor. Every
        # rank asks why: Megatron's signal handler answers by an all-gather.
        if exc.code in (0, None) and not wants_help:
            reason = _early_exit_reason()
            if rank() == 0:
                attempt_end.record(False, reason)
        raise
    if rank() == 0:
        attempt_end.record(True, "pretrain returned: the training is complete")


def _early_exit_reason() -> str:
    """Which of Megatron's early exits (each saves, then exits 0) ended training; a collective
    on Megatron's signal handler, so every rank calls it."""
    from megatron.training import get_args, get_signal_handler

    try:
        args = get_args()
    except AssertionError:  # Megatron's args were never set: training never started
        return "an exit before training started"
    if args.exit_signal_handler and any(get_signal_handler().signals_received()):
        return "a stop signal (--exit-signal-handler saved and exited)"
    flags = [
        f"--{name.replace('_', '-')} {value}"
        for name in ("exit_duration_in_mins", "exit_interval", "phase_transition_iterations")
        if (value := getattr(args, name, None))
    ]
    return f"{' or '.join(flags) or 'an early exit'} before the last iteration"
