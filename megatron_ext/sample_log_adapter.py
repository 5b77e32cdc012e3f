"""Megatron adapter for the sample log: the ``--sample-log-dir`` flag and the per-micro-batch
record written from the GPT loss function (see :mod:`megatron_ext.sample_log`)."""

from __future__ import annotations

import argparse
import hashlib
from typing import Any

import torch
from megatron.core import mpu

from megatron_ext.sample_log import SampleLog, SampleRecord


def add_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--sample-log-dir",
        type=str,
        default=None,
        help="Append, per DP rank, one JSON line per trained micro-batch: its global sample "
        "ids, a SHA-1 of each sample's tokens and the local token-summed loss "
        "(samples-dp{rank}.jsonl). Proves resume/skip exactness; answers who trained on what.",
    )


def install(args: Any) -> None:
    """Nothing to patch: the GPT adapter calls :func:`record` when the flag is set."""


def token_digest(tokens: torch.Tensor) -> str:
    """SHA-1 of one sample's token ids as little-endian int64 (what lookup tools recompute)."""
    return hashlib.sha1(tokens.detach().to("cpu", torch.int64).numpy().tobytes()).hexdigest()


class _State:
    """The open log and which micro-batch of the current iteration this rank is on."""

    log: SampleLog | None = None
    iteration = -1
    microbatch = 0


def record(args: Any, sample_ids: torch.Tensor, tokens: torch.Tensor, loss: torch.Tensor,
           num_tokens: torch.Tensor) -> None:
    """Append this rank's record for one trained micro-batch (iteration is 1-indexed)."""
    if _State.log is None:
        _State.log = SampleLog(args.sample_log_dir, mpu.get_data_parallel_rank())
    iteration = args.curr_iteration + 1
    if iteration != _State.iteration:
        _State.iteration, _State.microbatch = iteration, 0
    else:
        _State.microbatch += 1
    _State.log.write(
        SampleRecord(
            iteration=iteration,
            dp_rank=mpu.get_data_parallel_rank(),
            microbatch=_State.microbatch,
            sample_ids=[int(i) for i in sample_ids.view(-1).tolist()],
            token_sha1=[token_digest(row) for row in tokens],
            loss_sum=float(loss.detach().item()),
            num_tokens=int(num_tokens.item()),
        )
    )
