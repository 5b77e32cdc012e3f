"""Which global ranks read a DP rank's micro-batches (TP / PP / CP do not change the samples).

Megatron numbers ranks by ``RankGenerator`` with order ``tp-cp-ep-dp-pp`` (or ``tp-cp-ep-pp-dp``
with ``--use-tp-pp-dp-mapping``); expert parallelism has its own generator and does not split
data. In the GPT path the dataset is read on TP rank 0 of the first and of the last pipeline
stage, by every CP rank; TP peers receive the batch by broadcast, and CP rank c keeps sequence
chunks c and 2*CP-1-c of 2*CP equal chunks (``get_batch_on_this_cp_rank``).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ext.lookup.errors import PositionError


@dataclass(frozen=True)
class Topology:
    """Model-parallel layout of the run (sizes as in Megatron's args)."""

    data_parallel: int
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    context_parallel: int = 1
    tp_pp_dp_mapping: bool = False

    def rank(self, *, tp: int, cp: int, dp: int, pp: int) -> int:
        """Global rank of one coordinate, in Megatron's default rank order."""
        order = ("tp", "cp", "pp", "dp") if self.tp_pp_dp_mapping else ("tp", "cp", "dp", "pp")
        sizes = {
            "tp": self.tensor_parallel,
            "cp": self.context_parallel,
            "dp": self.data_parallel,
            "pp": self.pipeline_parallel,
        }
        coords = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
        rank, stride = 0, 1
        for name in order:
            rank += coords[name] * stride
            stride *= sizes[name]
        return rank

    def readers(self, dp_rank: int) -> list[int]:
        """Global ranks that read DP rank ``dp_rank``'s micro-batches from the dataset."""
        if not 0 <= dp_rank < self.data_parallel:
            raise PositionError(f"DP ranks are 0..{self.data_parallel - 1}: {dp_rank}")
        stages = sorted({0, self.pipeline_parallel - 1})
        return sorted(
            self.rank(tp=0, cp=cp, dp=dp_rank, pp=pp)
            for pp in stages
            for cp in range(self.context_parallel)
        )

    def describe(self) -> str:
        """One line for humans: what TP/PP/CP mean for the samples shown."""
        parts = [f"DP={self.data_parallel}"]
        if self.tensor_parallel > 1:
            parts.append(f"TP={self.tensor_parallel} (TP rank 0 reads, peers get a broadcast)")
        if self.pipeline_parallel > 1:
            parts.append(f"PP={self.pipeline_parallel} (first and last stage read)")
        if self.context_parallel > 1:
            parts.append(
                f"CP={self.context_parallel} (every CP rank reads; rank c trains on sequence "
                f"chunks c and {2 * self.context_parallel - 1}-c of {2 * self.context_parallel})"
            )
        return ", ".join(parts)
