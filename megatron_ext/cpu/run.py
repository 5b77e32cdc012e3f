"""Run ``pretrain_gpt_ext.py`` on CPU: install the counted CUDA shims, then the real entry point.

``torchrun ... megatron_ext/cpu/run.py <args>`` (what ``megatron-ext train --cpu`` runs);
``--script PATH <args>`` runs a pretrain script of the user's own as ``__main__`` instead, and
``--bridge-script PATH <args>`` a Megatron-Bridge script (with :mod:`megatron_ext.cpu.bridge`).
Each rank also records its batch reads and the exit code it chose (``exit-rankN.json``), so a
rank that exits on its own is told apart from one torchrun terminated.
"""

import atexit
import gc
import os
import runpy
import sys
from collections.abc import Callable

_EXIT_CODE = [1]  # what the interpreter would exit with; set where the run ends


def _skip_interpreter_teardown() -> None:
    """Registered first, so it runs after every other exit handler: end at once with the exit
    code the process would have had, skipping the interpreter's teardown of torch and
    megatron-core (seconds of CPU per rank, nothing to write)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT_CODE[0])


def _training(argv: list[str]) -> Callable[[], object]:
    """What to run: the entry point with ``argv``, or with ``--script PATH`` first, that
    script as ``__main__`` with the rest as its command line and its folder on ``sys.path``."""
    if argv[:1] == ["--bridge-script"]:
        from megatron_ext.cpu import bridge

        bridge.install()
        argv = ["--script", *argv[1:]]
    if argv[:1] != ["--script"]:
        import pretrain_gpt_ext

        return lambda: pretrain_gpt_ext.main(argv)
    script, *flags = argv[1:]
    sys.argv = [script, *flags]
    # As `python script.py` does: the script's folder first, for its sibling imports
    # (Megatron-LM's pretrain_gpt.py imports gpt_builders and model_provider).
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    return lambda: runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":  # checkpoint saving spawns helper processes that re-import main
    # Young-generation collections every 10,000 allocations, not 700: the start-up imports
    # (torch, megatron-core, transformers) make millions of objects and little cyclic garbage,
    # so the default threshold spends ~9 % of those imports' CPU in the collector.
    gc.set_threshold(10_000)
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
        # The status the interpreter gives this SystemExit.
        _EXIT_CODE[0] = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        raise
    shims.record_exit(0)
    _EXIT_CODE[0] = 0
