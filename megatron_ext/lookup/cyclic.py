"""``--dataloader-type cyclic``: ``MegatronPretrainingRandomSampler``'s order as a function.

The cyclic sampler (megatron/training/datasets/data_samplers.py) draws each epoch's order
from ``torch.randperm`` seeded with the epoch number; it is a pure function of the
consumed-samples position, so stream positions from :mod:`megatron_ext.lookup.position` map
to dataset indices exactly. Only torch's permutation is needed (numpy cannot reproduce it).

With data sharding (Megatron's default) an epoch is ``active = total - total % (mbs*DP)``
samples; DP rank r owns bucket ``[r*B, (r+1)*B)`` with ``B = active / DP`` and walks it in the
epoch's permutation. Without sharding, rank r takes every DP-th element of one permutation of
``(total // mbs) * mbs`` samples; when that differs from ``active`` the ranks disagree on where
an epoch ends (Megatron's own ranks then desynchronise), so that case is refused.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from megatron_ext.lookup.errors import ConfigError


@lru_cache(maxsize=4)
def _permutation(size: int, epoch: int) -> np.ndarray:
    generator = torch.Generator()
    generator.manual_seed(epoch)
    return torch.randperm(size, generator=generator).numpy()


@lru_cache(maxsize=4)
def _inverse(size: int, epoch: int) -> np.ndarray:
    inverse = np.empty(size, dtype=np.int64)
    inverse[_permutation(size, epoch)] = np.arange(size, dtype=np.int64)
    return inverse


class CyclicOrder:
    """Stream position <-> dataset index for ``MegatronPretrainingRandomSampler``."""

    def __init__(
        self,
        total_samples: int,
        micro_batch_size: int,
        data_parallel_size: int,
        data_sharding: bool,
    ) -> None:
        self.mbs, self.dp, self.sharding = micro_batch_size, data_parallel_size, data_sharding
        unit = micro_batch_size * data_parallel_size
        self.active = total_samples - total_samples % unit
        self.bucket = (total_samples // unit) * micro_batch_size  # per rank, with sharding
        if self.active == 0:
            raise ConfigError(f"the dataset ({total_samples} samples) is smaller than mbs x DP")
        full = (total_samples // micro_batch_size) * micro_batch_size
        if not data_sharding and full != self.active:
            raise ConfigError(
                "--dataloader-type cyclic --no-data-sharding with a dataset size "
                f"({total_samples}) whose remainder modulo mbs x DP is at least mbs: Megatron's "
                "ranks disagree on the epoch length, so no exact answer exists"
            )

    def _perm_size(self) -> int:
        return self.bucket if self.sharding else self.active

    def dataset_indices(self, positions: np.ndarray) -> np.ndarray:
        """Dataset index of each stream position (``consumed + r*mbs + t`` of a micro-batch)."""
        positions = np.asarray(positions, dtype=np.int64)
        unit = self.mbs * self.dp
        epoch, within = np.divmod(positions, self.active)
        start, rest = within - within % unit, within % unit
        rank, slot = rest // self.mbs, rest % self.mbs
        out = np.empty_like(positions)
        for e in np.unique(epoch):
            here = epoch == e
            perm = _permutation(self._perm_size(), int(e))
            if self.sharding:
                out[here] = rank[here] * self.bucket + perm[start[here] // self.dp + slot[here]]
            else:
                out[here] = perm[start[here] + rank[here] + self.dp * slot[here]]
        return out

    def positions_of(self, indices: np.ndarray, epochs: int) -> tuple[np.ndarray, np.ndarray]:
        """Stream positions at which ``indices`` are read in epochs ``0..epochs-1``.

        Returns (positions, which input each came from); indices the sampler never reads (the
        tail past ``active``) have no position.
        """
        indices = np.asarray(indices, dtype=np.int64)
        keep = np.flatnonzero(indices < self.active)
        found, origin = [], []
        for e in range(epochs):
            inverse = _inverse(self._perm_size(), e)
            if self.sharding:
                rank, q = np.divmod(indices[keep], self.bucket)
                q = inverse[q]
                within = (q - q % self.mbs) * self.dp + rank * self.mbs + q % self.mbs
            else:
                q = inverse[indices[keep]]
                unit = self.mbs * self.dp
                rest = q % unit
                within = q - rest + (rest % self.dp) * self.mbs + rest // self.dp
            found.append(e * self.active + within)
            origin.append(keep)
        if not found:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        return np.concatenate(found), np.concatenate(origin)
