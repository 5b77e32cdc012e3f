"""Every megatron-ext command-line flag, in one argument group added to Megatron's parser.

Flags follow Megatron's conventions (``--kebab-case``). With none of them set, a run is
plain Megatron (apart from the upstream bug fixes listed by ``megatron-ext patches``).
"""

from __future__ import annotations

import argparse


def add_megatron_ext_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``extra_args_provider`` for ``parse_and_validate_args``."""
    group = parser.add_argument_group(title="megatron-ext")
    group.add_argument(
        "--sample-log-dir",
        type=str,
        default=None,
        help="Append, per DP rank, one JSON line per trained micro-batch with its global "
        "sample ids and local loss (samples-dp{rank}.jsonl). Used to prove resume/skip "
        "exactness and to answer which rank trained on what.",
    )
    return parser
