"""Run ``pretrain_gpt_ext.py`` on CPU: install the counted CUDA shims, then the real entry point.

Usage (world size 2): ``python -m torch.distributed.run --nproc-per-node 2
megatron_ext/cpu/run.py <megatron and megatron-ext args>`` (what ``megatron-ext train --cpu``
runs, with the CPU flags first). ``run.py --script PATH <args>`` runs the pretrain script at
PATH as ``__main__`` instead (a script of the user's own on :mod:`megatron_ext.fork`, such as
``docs/examples/pretrain_gpt_fork.py``), under the same shims; ``run.py --bridge-script PATH
<args>`` runs a Megatron-Bridge script the same way, with the harness's Bridge additions
(:mod:`megatron_ext.cpu.bridge`).

Besides the shim counters, each rank records what tests cannot read from the run's own files:
how many micro-batches it read from the data iterator, per DP rank it read them for, and the
exit code it chose (written the moment ``SystemExit`` reaches this script, so a rank that
exits on its own is told apart from one torchrun terminated after a peer exited first).
"""

import atexit
import os
import runpy
import sys
from collections.abc import Callable

_EXIT_CODE = [1]  # what the interpreter would exit with; set where the run ends


def _skip_interpreter_teardown() -> None:
    """Registered first, so it runs after every other exit handler (Megatron's, the checkpoint
    writer's Manager shutdown, the shims' counter dump): then the process ends at once with
    the exit code it would have had. What it skips is the interpreter's teardown of torch and
    megatron-core modules, ~2 s of CPU per rank and launch with nothing to write (every file
    the overlay and the harness write is flushed record by record)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT_CODE[0])


def _code(exit_code: object) -> int:
    """The status the interpreter gives a ``SystemExit`` with this code."""
    if exit_code is None:
        return 0
    return exit_code if isinstance(exit_code, int) else 1


def _training(argv: list[str]) -> Callable[[], object]:
    """What to run: the entry point with ``argv``, or with ``--script PATH`` first, that
    script as ``__main__`` with the rest as its command line."""
    if argv[:1] == ["--bridge-script"]:
        from megatron_ext.cpu import bridge

        bridge.install()
        argv = ["--script", *argv[1:]]
    if argv[:1] != ["--script"]:
        import pretrain_gpt_ext

        return lambda: pretrain_gpt_ext.main(argv)
    script, *flags = argv[1:]
    sys.argv = [script, *flags]
    return lambda: runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":  # checkpoint saving spawns helper processes that re-import main
    atexit.register(_skip_interpreter_teardown)
    from megatron_ext.cpu import shims

    shims.install()

    from megatron_ext.registry.fixes import start_results_queue

    train = _training(sys.argv[1:])
    start_results_queue("fork")  # now, while this process has one thread (see its docstring)
    shims.record_batch_reads()
    try:
        train()
    except SystemExit as exc:
        shims.record_exit(exc.code)
        _EXIT_CODE[0] = _code(exc.code)
        raise
    shims.record_exit(0)
    _EXIT_CODE[0] = 0
