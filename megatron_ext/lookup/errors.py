"""Refusals: the lookup answers exactly or says, in one message, why not and what would make an
exact answer possible."""

from __future__ import annotations

from megatron_ext.common import exit_codes
from megatron_ext.common.errors import Refusal


class Refused(Refusal):
    """The tool cannot give an exact answer; the message says why and what to do."""


class PositionError(Refused):
    """The requested iteration/rank/sample is outside what the run did or can be derived."""


class ConfigError(Refused):
    """The run's configuration is incomplete, contradictory or uses an unsupported mode."""


class CacheMissing(Refused):
    """The index caches the run used are not on disk (offer ``--rebuild-caches``)."""


class DataChanged(Refused):
    """The .bin/.idx or cache files on disk are not what the caches were built from."""


class NotTrained(PositionError):
    """The run has not reached the iteration: no batch is shown as if it had been trained."""

    exit_code = exit_codes.NOT_TRAINED


class TwoWriters(Refused):
    """One attempt's sample log holds two records of one micro-batch: two trainings wrote it."""
