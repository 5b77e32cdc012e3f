"""Per-source loss and tokens of each global batch, summed per blend member (megatron-core's
``dataset_id``) on device with no host sync; they travel in the after-step all-reduce
(:mod:`.step_sums`). No Megatron imports.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class SourceAccumulator:
    """Token-summed loss and tokens per blend member over one iteration's micro-batches."""

    def __init__(self, names: list[str], device: torch.device | str) -> None:
        self.names = names
        # rows: [loss sum, tokens] per member; float64 so token counts stay exact.
        self.sums = torch.zeros(2, len(names), dtype=torch.float64, device=device)

    def add(self, per_token: torch.Tensor, mask: torch.Tensor, dataset_ids: Any) -> None:
        """One micro-batch: ``[b, s]`` pure-CE loss, its flat loss mask, ``[b]`` member indices
        (None: one dataset, which Megatron does not wrap in a BlendedDataset)."""
        rows = per_token.shape[0]
        weights = mask.reshape(rows, -1).to(torch.float64)
        loss = (per_token.reshape(rows, -1).to(torch.float64) * weights).sum(dim=1)
        if dataset_ids is None and len(self.names) > 1:
            raise RuntimeError(
                f"megatron-ext telemetry: a micro-batch of a {len(self.names)}-member blend "
                "came without dataset_id (registry assumption blended-dataset-id); "
                "re-verify megatron_ext.loop.gpt_step against megatron-core's BlendedDataset"
            )
        if dataset_ids is None:
            index = torch.zeros(rows, dtype=torch.int64, device=self.sums.device)
        else:
            index = torch.as_tensor(dataset_ids).reshape(-1).to(self.sums.device, torch.int64)
            if index.numel() != rows:
                raise RuntimeError(
                    f"megatron-ext telemetry: {index.numel()} dataset ids for a micro-batch "
                    f"of {rows} samples; the batch no longer matches its dataset_id entries"
                )
        self.sums[0].index_add_(0, index, loss)
        self.sums[1].index_add_(0, index, weights.sum(dim=1))

    def reduce(self, group: Any) -> tuple[dict[str, float], dict[str, int]]:
        """Sum over ``group`` (the ranks that read distinct data), read and reset: (loss by
        member with tokens, tokens by member)."""
        if dist.is_initialized():
            dist.all_reduce(self.sums, group=group)
        return self.read(self.names, self.take().reshape(-1).tolist())

    def take(self) -> torch.Tensor:
        """This iteration's ``[2, K]`` sums (a copy, still on device); resets them."""
        sums = self.sums.clone()
        self.sums.zero_()
        return sums

    @staticmethod
    def read(names: list[str], values: list[float]) -> tuple[dict[str, float], dict[str, int]]:
        """Summed ``[2, K]`` values, flat on the host: (loss by member with tokens, tokens by
        member)."""
        loss_sums, tokens = values[: len(names)], values[len(names) : 2 * len(names)]
        losses = {n: s / t for n, s, t in zip(names, loss_sums, tokens) if t > 0}
        return losses, {n: round(t) for n, t in zip(names, tokens)}


def format_sources(losses: dict[str, float], tokens: dict[str, int]) -> str:
    """The console's per-source part of an iteration line."""
    return " | ".join(
        f"{name}: {losses[name]:.4f} ({tokens[name]} tok)" if name in losses else f"{name}: -"
        for name in tokens
    )
