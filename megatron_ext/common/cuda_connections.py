"""``CUDA_DEVICE_MAX_CONNECTIONS`` for a training command line: one rule for the launchers, the
CPU runner and the entry point (standard library only: the supervisor imports it).

TP/CP rely on ``1``, FSDP asserts it is not ``1`` (and wins): ``1`` by default, ``8`` with an
FSDP flag, and an explicit ``1`` with an FSDP flag is refused before Megatron's assertion.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from megatron_ext.common.errors import StartupError

ENV = "CUDA_DEVICE_MAX_CONNECTIONS"
FSDP_FLAGS = ("--use-torch-fsdp2", "--use-megatron-fsdp")
ORDERED = "1"  # TP/CP/SP: kernels in issue order
FSDP_DEFAULT = "8"  # CUDA's default number of connections


def fsdp_flag(argv: Iterable[str]) -> str | None:
    """The FSDP flag among ``argv`` (Megatron's parser takes no abbreviations), if any."""
    return next((arg for arg in argv if arg in FSDP_FLAGS), None)


def default_for(argv: Iterable[str]) -> str:
    """The value a launcher sets when the user set none."""
    return FSDP_DEFAULT if fsdp_flag(argv) else ORDERED


def problem(argv: Iterable[str], value: str | None) -> str | None:
    """Why ``value`` (the environment's, None when unset) cannot train ``argv``; None if it can."""
    flag = fsdp_flag(argv)
    if flag is None or value is None or value.strip() != ORDERED:
        return None
    return (
        f"{ENV}=1 with {flag}: Megatron asserts that FSDP runs with more than one CUDA "
        f"connection. Unset {ENV} or set it above 1 (the launchers set {FSDP_DEFAULT} with an "
        "FSDP flag when it is not set)."
    )


def check(argv: Iterable[str], env: Mapping[str, str]) -> None:
    """Refuse what :func:`problem` finds (:class:`StartupError`: its message, exit 1)."""
    found = problem(list(argv), env.get(ENV))
    if found:
        raise StartupError(found)
