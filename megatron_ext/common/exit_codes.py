"""Every exit code a megatron-ext process ends with or acts on, one definition each; dependency
free, so the supervisor and the training read the same constants.
"""

from __future__ import annotations

REFUSED = 1
"""A refusal of the input (a lookup, a corpus, feature flags), said in one readable message."""

USAGE = 2
"""A usage error: argparse's, and the tools' refusals of their own arguments."""

NOT_TRAINED = 3
"""``megatron-ext lookup`` of an iteration the run has not reached yet (no answer given)."""

RESUME_TO_DISAMBIGUATE = 16
"""Megatron's ``EXIT_CODE_RESUME_TO_DISAMBIGUATE``: restart from the last checkpoint."""

FAILED_ON_RESULT_VALIDATION = 17
"""Megatron's ``EXIT_CODE_FAILED_ON_RESULT_VALIDATION``: a result failed validation twice."""

STOPPED_EARLY = 75
"""The supervisor's exit when the training keeps stopping early without progress (EX_TEMPFAIL)."""

SPIKE_ROLLBACK = 42
"""The default ``--spike-exit-code``: every rank asks the supervisor for a rollback."""

KILLED = 128 + 9
"""What a shell (the rank wrapper) reports for a child killed by SIGKILL."""

HUNG = 43
"""A rank's hang watchdog saw no progress within its bound (stacks dumped; restart)."""
