"""The overlay's one after-step collective: each rank's per-source sums, its DP replica's
loss and tokens, its busy time and peer group in its slots of one float64 vector summed over
every rank; the writer reads the worst DP rank, per-source losses and the slowest rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from megatron_ext.telemetry.sources import SourceAccumulator
from megatron_ext.telemetry.stragglers import Slowest, slowest


@dataclass
class StepValues:
    """What the writer reads from the vector (empty elsewhere, or without --signals-dir)."""

    worst_loss: float | None = None  # the worst DP replica's token-averaged lm loss
    worst_rank: int | None = None  # its DP rank
    by_dataset: tuple[dict[str, float], dict[str, int]] = field(default_factory=lambda: ({}, {}))
    slowest: Slowest | None = None


@dataclass(frozen=True)
class StepSums:
    """The vector's layout: ``sources`` blend members, ``replicas`` DP ranks, ``world`` ranks."""

    sources: int
    replicas: int
    world: int

    @property
    def size(self) -> int:
        return 2 * self.sources + 2 * self.replicas + 2 * self.world

    def pack(
        self,
        device: torch.device | str,
        rank: int,
        busy: float,
        group: int,
        sources: torch.Tensor | None = None,
        loss: tuple[torch.Tensor, torch.Tensor] | None = None,
        replica: int = 0,
    ) -> torch.Tensor:
        """This rank's part: its busy seconds and peer ``group`` (a rank id) in its own slots,
        ``sources`` (``[2, K]`` sums) and its replica's ``loss`` (sum, tokens) where given."""
        values = torch.zeros(self.size, dtype=torch.float64, device=device)
        k, r = 2 * self.sources, 2 * self.replicas
        if sources is not None:
            values[:k] = sources.reshape(-1)
        if loss is not None:
            values[k + 2 * replica : k + 2 * replica + 2] = torch.stack(loss).to(values)
        values[k + r + rank] = busy
        values[k + r + self.world + rank] = group + 1  # 0: a rank that added nothing
        return values

    def read(self, values: list[float], members: list[str]) -> StepValues:
        """The summed vector (read to the host once) as the step's values."""
        k, r, w = 2 * self.sources, 2 * self.replicas, self.world
        step = StepValues()
        if members:
            step.by_dataset = SourceAccumulator.read(members, values[:k])
        step.worst_loss, step.worst_rank = _worst(values[k : k + r])
        groups = np.rint(values[k + r + w : k + r + 2 * w]).astype(np.int64) - 1
        step.slowest = slowest(values[k + r : k + r + w], groups)
        return step


def _worst(pairs: list[float]) -> tuple[float | None, int | None]:
    """The replica with the highest token-averaged loss, divided in fp32 as the sums were
    accumulated (the first of equals)."""
    sums, tokens = pairs[0::2], pairs[1::2]
    if not any(tokens) and not any(sums):
        return None, None
    with np.errstate(all="ignore"):
        local = (np.asarray(sums, np.float32) / np.asarray(tokens, np.float32)).tolist()
    worst = max(range(len(local)), key=lambda i: local[i])
    return local[worst], worst
