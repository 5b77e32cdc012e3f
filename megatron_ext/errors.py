"""The one exception base of megatron-ext: a refusal that carries its message and exit code.

Every error the overlay raises on purpose (bad flags, unreadable files, a target Megatron
changed, a lookup that cannot be answered) is a :class:`MegatronExtError`. Its message says
what is wrong and what to do; its ``exit_code`` is what the process ends with. The entry
point and every CLI turn one into that message on stderr and that code, with no traceback
(:func:`exit_on_error`), so an on-call engineer reads a sentence, not a stack.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import ClassVar


class MegatronExtError(Exception):
    """A refusal with a readable message; subclasses set the exit code they end with."""

    exit_code: ClassVar[int] = 2
    prefix: ClassVar[str] = "megatron-ext"

    def __str__(self) -> str:
        message = super().__str__()
        if message.startswith(f"{self.prefix}:") or not self.prefix:
            return message
        return f"{self.prefix}: {message}"


def exit_on_error[T](main: Callable[[], T]) -> T:
    """Run ``main``; a :class:`MegatronExtError` ends the process with its message and code."""
    try:
        return main()
    except MegatronExtError as exc:
        print(str(exc), file=sys.stderr, flush=True)
        raise SystemExit(exc.exit_code) from None
