"""Start-up checks of overlay flag values, shared by the features and the supervisor.

A value argparse accepts can still switch the safety net off while the job reports success
(``--spike-exit-code 256`` is exit status 0; a NaN threshold flags nothing). Each check raises
:class:`ValueError` naming the flag, the value and what is allowed; callers turn it into their
own refusal before distributed initialisation. No torch, no Megatron.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from megatron_ext.common import exit_codes

# Exit statuses that already mean something to the supervisor, a shell or Megatron; a
# rollback request spelled as one of them would be read as that instead.
RESERVED_EXIT_CODES: dict[int, str] = {
    0: "success",
    exit_codes.REFUSED: "a Python crash or a refusal (uncaught exception)",
    exit_codes.USAGE: "a usage error (argparse, a megatron-ext refusal)",
    exit_codes.RESUME_TO_DISAMBIGUATE: "Megatron's EXIT_CODE_RESUME_TO_DISAMBIGUATE",
    exit_codes.FAILED_ON_RESULT_VALIDATION: "Megatron's EXIT_CODE_FAILED_ON_RESULT_VALIDATION",
    exit_codes.HUNG: "megatron-ext's hang watchdog (a rank made no progress)",
    126: "a shell's 'command not executable'",
    127: "a shell's 'command not found'",
}
SIGNAL_EXIT_CODES = range(128, 256)  # 128+N: killed by signal N (137 = SIGKILL restarts)


def check_exit_code(flag: str, code: int) -> None:
    """An exit code the supervisor can tell apart from every other outcome: 3-125 other than
    16, 17 and 43. Raises ValueError otherwise."""
    allowed = "an integer in 3-125 other than 16, 17 and 43"
    if not 0 <= code <= 255:
        raise ValueError(
            f"{flag} {code}: exit statuses are 8 bits, so {code} would end the process as "
            f"{code % 256} ({RESERVED_EXIT_CODES.get(code % 256, 'another code')}); use {allowed}"
        )
    if code in SIGNAL_EXIT_CODES:
        raise ValueError(
            f"{flag} {code}: 128-255 mean 'killed by signal {code - 128}' to a shell and the "
            f"supervisor; use {allowed}"
        )
    if code in RESERVED_EXIT_CODES:
        raise ValueError(
            f"{flag} {code}: {code} already means {RESERVED_EXIT_CODES[code]}; use {allowed}"
        )


def check_finite(flag: str, value: float, *, minimum: float) -> None:
    """A finite number >= ``minimum`` (NaN compares False with every loss: it flags nothing)."""
    if not math.isfinite(value):
        raise ValueError(f"{flag} must be a finite number, got {value}")
    if value < minimum:
        raise ValueError(f"{flag} must be >= {minimum}, got {value}")


def check_directory(flag: str, path: str | os.PathLike[str]) -> None:
    """A path that is, or can become, a writable directory: not a file, nothing on the way
    to it a file, and writable where it exists (checked before any model is built)."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise ValueError(f"{flag} {path}: exists and is not a directory; name a directory")
    existing = target
    while not existing.exists():
        if existing.is_symlink():
            raise ValueError(f"{flag} {path}: {existing} is a dangling symlink")
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{flag} {path}: {existing} is a file, so {path} cannot be a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: {existing} is not writable by this user")
