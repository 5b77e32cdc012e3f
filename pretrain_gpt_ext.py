"""Pretrain GPT with megatron-ext: Megatron-LM's ``pretrain_gpt.py`` semantics plus the overlay.

Run it like Megatron-LM's script (``torchrun ... pretrain_gpt_ext.py <megatron args>``); the
megatron-ext flags are their own argument group (``--help``). Without them, training is plain
Megatron apart from the upstream bug fixes ``megatron-ext patches`` lists.
"""

import time

_PROGRAM_START_TIME = time.time()

import sys  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    """Train with ``argv`` (default: the command line); see :func:`megatron_ext.fork.start.main`."""
    from megatron_ext.fork import start

    start.main(sys.argv[1:] if argv is None else argv, program_start=_PROGRAM_START_TIME)


if __name__ == "__main__":
    main()
