"""Pretrain GPT with megatron-ext: Megatron-LM's ``pretrain_gpt.py`` semantics plus the overlay.

Run it exactly like Megatron-LM's script (``torchrun ... pretrain_gpt_ext.py <megatron args>``);
megatron-ext flags live in their own argument group (``--help``). With no megatron-ext flag
set, training is plain Megatron, apart from the upstream bug fixes listed by
``megatron-ext patches``. It is the overlay's own GPT step (:mod:`megatron_ext.loop.gpt_step`)
through the start-up a pretrain script of the user's own gets from :mod:`megatron_ext.fork`
(:mod:`megatron_ext.fork.start`).
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
