"""The one exception base of megatron-ext: a refusal that carries its message and exit code.

Every error raised on purpose is a :class:`MegatronExtError` (its message says what to do,
:func:`report` / :func:`exit_on_error` print it without a traceback); classes that callers also
catch as a built-in error keep that as a second base.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import ClassVar

from megatron_ext.common import exit_codes


class MegatronExtError(Exception):
    """A refusal with a readable message; subclasses set the exit code they end with."""

    exit_code: ClassVar[int] = exit_codes.USAGE
    prefix: ClassVar[str] = "megatron-ext"

    def __str__(self) -> str:
        message = super().__str__()
        if message.startswith(f"{self.prefix}:") or not self.prefix:
            return message
        return f"{self.prefix}: {message}"


class Refusal(MegatronExtError):
    """The input cannot be used as given (exit 1); the message is kept as written."""

    exit_code = exit_codes.REFUSED
    prefix = ""


class UsageError(MegatronExtError):
    """The command's own arguments cannot work (exit 2); the message is kept as written."""

    exit_code = exit_codes.USAGE
    prefix = ""


class StartupError(MegatronExtError):
    """Training refuses to start (exit 1): ``megatron-ext: <what to do>``, on every rank."""

    exit_code = exit_codes.REFUSED


def report(exc: MegatronExtError, program: str | None = None) -> int:
    """Print ``exc``'s message on stderr (after ``program: `` when given); its exit code."""
    print(f"{program}: {exc}" if program else str(exc), file=sys.stderr, flush=True)
    return exc.exit_code


def exit_on_error[T](main: Callable[[], T]) -> T:
    """Run ``main``; a :class:`MegatronExtError` ends the process with its message and code."""
    try:
        return main()
    except MegatronExtError as exc:
        raise SystemExit(report(exc)) from None
