"""Incident drill: a reproducible bad batch on one DP rank at chosen iterations.

Why: the spike pipeline must be proven end to end on a reproducible bad batch. The corruption
is a pure function of (iteration, DP rank), injected where TP rank 0 reads the batch, so a
replay from a checkpoint reproduces it exactly and ``--iterations-to-skip`` removes it
(skipped iterations never reach the batch code). Flag: ``--drill-corrupt-batch
START[-END]:DP_RANK`` (``*``: every rank), with ``--drill-corruption``, and
``--drill-corrupt-source NAME`` to corrupt only that blend member's samples (a bad source at its
share of the mixture, on every rank it is read on):

- ``garbage``: every sample of the rank is replaced by uniform random tokens (the loss jumps
  towards ln V on that rank);
- ``mis-encoded``: the real-shaped drill. The rank's samples keep their documents but every
  token id ``t`` becomes ``V-1-t`` (V: the padded vocabulary), as text read with the wrong code
  page: the frequent low ids of a BPE vocabulary turn into rare or never-seen ones (seed 000
  ch.2 §5: "encoding errors produce frequent rare tokens"). It is the benchmark's bad-batch
  fingerprint: one rank's loss jumps, the DP average only by that rank's share, the grad norm
  need not move; ``megatron-ext lookup --worst`` must name exactly these samples' documents,
  which are real documents of the run's data.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_SPEC = re.compile(r"^(\d+)(?:-(\d+))?:(\d+|\*)$")
CORRUPTIONS = ("garbage", "mis-encoded")


@dataclass(frozen=True)
class CorruptionSpec:
    first: int
    last: int
    dp_rank: int | None  # None: every DP rank (``*``)

    def hits(self, iteration: int, dp_rank: int) -> bool:
        return self.first <= iteration <= self.last and self.dp_rank in (None, dp_rank)


def parse_spec(text: str) -> CorruptionSpec:
    """``"40:1"`` or ``"40-45:1"`` (1-indexed iterations, inclusive) on DP rank 1; ``"40:*"``
    on every DP rank (with ``--drill-corrupt-source``: one source's samples everywhere)."""
    match = _SPEC.match(text.strip())
    if not match:
        raise ValueError(
            f"--drill-corrupt-batch {text!r}: expected START[-END]:DP_RANK (or :* for every "
            "rank), e.g. 40-45:1"
        )
    first, last = int(match[1]), int(match[2] or match[1])
    rank = None if match[3] == "*" else int(match[3])
    if first < 1 or last < first:
        raise ValueError(f"--drill-corrupt-batch {text!r}: need 1 <= START <= END")
    return CorruptionSpec(first, last, rank)


def garbage_batch(
    tokens: torch.Tensor, iteration: int, dp_rank: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform random tokens and their next-token labels, seeded by (iteration, rank)."""
    generator = torch.Generator().manual_seed(1_000_003 * iteration + dp_rank)
    batch, length = tokens.shape
    sequence = torch.randint(0, vocab_size, (batch, length + 1), generator=generator)
    return sequence[:, :-1].to(tokens.dtype), sequence[:, 1:].to(tokens.dtype)


def misencode(
    tokens: torch.Tensor, labels: torch.Tensor, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens`` and ``labels`` with every id ``t`` read as ``vocab_size - 1 - t``."""
    return vocab_size - 1 - tokens, vocab_size - 1 - labels
