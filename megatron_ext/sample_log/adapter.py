"""The sample-log feature in Megatron: ``--sample-log-dir``.

On TP rank 0 of the last stage, ``on_batch`` takes each micro-batch's sample ids (added by
:class:`SampleIdDataset`) and token SHA-1s as trained, ``on_loss`` keeps its losses on the
device, and ``after_step`` makes one host transfer and writes one record per micro-batch (CP
rank 0, the sums added over the CP group). Global rank 0 appends the layout line at ``on_setup``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import mpu

from megatron_ext.common.features import (
    LM_LOSS_PER_TOKEN,
    Feature,
    FeatureError,
    LossInputs,
    MicroBatch,
    StepRecord,
)
from megatron_ext.common.io import token_sha1
from megatron_ext.common.records.sample_log import (
    SampleLog,
    SampleRecord,
    append_layout,
    layout_record,
)
from megatron_ext.common.run_lock import job_id
from megatron_ext.common.validation import check_directory

SAMPLE_ID_KEY = "sample_id"  # added to every train sample by SampleIdDataset
_NOTE = "sample_log"  # key of this feature's note in MicroBatch.extras


class SampleIdDataset(torch.utils.data.Dataset):
    """Adds the global sample index to each sample; attributes fall through to the wrapped
    dataset, and Megatron's batch code ignores the extra key."""

    def __init__(self, dataset: torch.utils.data.Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, idx: int) -> dict[str, Any]:
        sample = dict(self.dataset[idx])
        sample[SAMPLE_ID_KEY] = torch.tensor(int(idx), dtype=torch.int64)
        return sample

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


class SampleLogFeature(Feature):
    """Writes ``samples-dp{rank}.jsonl``: one line per trained micro-batch."""

    name = "sample_log"

    def __init__(self) -> None:
        self.args: Any = None
        self.log: SampleLog | None = None
        # (micro-batch, sample ids, token digests, [loss, tokens, lm loss, per-sample losses])
        self.pending: list[tuple[MicroBatch, list[int], list[str], torch.Tensor]] = []

    def add_args(self, group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--sample-log-dir",
            help="Append, per DP rank, one JSON line per trained micro-batch: its global "
            "sample ids, a SHA-1 of each sample's tokens, the local token-summed loss and each "
            "sample's token-averaged loss (samples-dp{rank}.jsonl). Proves resume/skip "
            "exactness; answers who trained on what.",
        )

    def enabled(self, args: Any) -> bool:
        return bool(args.sample_log_dir)

    def validate(self, args: Any) -> None:
        try:
            check_directory("--sample-log-dir", args.sample_log_dir)
        except ValueError as exc:
            raise FeatureError(str(exc)) from None

    def install(self, args: Any) -> None:
        self.args = args

    def on_train_dataset(self, dataset: Any) -> Any:
        return SampleIdDataset(dataset)

    def on_setup(self, model: list[Any], optimizer: Any) -> None:
        if dist.get_rank() == 0:
            # Megatron set the resume iteration and consumed samples on these args (its
            # global args: the entry point checks they are the ones the features hold).
            layout = layout_record(self.args, job_id(), time.time())
            append_layout(self.args.sample_log_dir, layout)

    def on_batch(self, batch: dict[str, Any], micro_batch: MicroBatch) -> None:
        if not (micro_batch.training and mpu.is_pipeline_last_stage()):
            return
        ids = batch[SAMPLE_ID_KEY].view(-1).tolist()  # host tensors: no device sync
        digests = [token_sha1(row) for row in batch["tokens"]]
        micro_batch.extras[_NOTE] = (ids, digests)

    def on_loss(self, inputs: LossInputs) -> dict[str, Any]:
        note = inputs.micro_batch.extras.get(_NOTE)
        if note is None:
            return {}
        ids, digests = note
        mask = inputs.mask.view(len(ids), -1)
        per_token = inputs.per_token.detach().float().reshape(mask.shape)
        lm_per_token = inputs.micro_batch.extras.get(LM_LOSS_PER_TOKEN)
        loss = inputs.loss.detach().float()
        lm_loss = loss if lm_per_token is None else (lm_per_token.float() * mask).sum()
        # A new tensor: Megatron's schedule divides the returned loss in place right after this.
        # Sums, not means: under CP this rank holds part of each sequence (after_step adds).
        totals = [loss.view(1), inputs.num_tokens.detach().float().view(1), lm_loss.view(1)]
        scalars = torch.cat([*totals, (per_token * mask).sum(dim=1), mask.sum(dim=1)])
        self.pending.append((inputs.micro_batch, ids, digests, scalars))
        return {}

    def after_step(self, record: StepRecord) -> None:
        pending, self.pending = self.pending, []
        if not pending:
            return
        if self.log is None:
            self.log = SampleLog(self.args.sample_log_dir, pending[0][0].dp_rank, job_id())
        sums = torch.stack([values for *_, values in pending])
        if mpu.get_context_parallel_world_size() > 1:
            # Every CP rank read the micro-batch and trained on its part of each sequence: the
            # whole sample's sums are theirs added, written once (by CP rank 0).
            dist.all_reduce(sums, group=mpu.get_context_parallel_group())
            if mpu.get_context_parallel_rank() != 0:
                return
        samples = (sums.shape[1] - 3) // 2
        per_sample = sums[:, 3 : 3 + samples] / sums[:, 3 + samples :].clamp(min=1)
        # One device->host transfer per iteration for every scalar of every micro-batch.
        scalars = torch.cat([sums[:, :3], per_sample], dim=1).tolist()
        for index, ((micro_batch, ids, digests, _), values) in enumerate(zip(pending, scalars)):
            self.log.write(
                SampleRecord(
                    iteration=micro_batch.iteration,
                    dp_rank=micro_batch.dp_rank,
                    microbatch=index,
                    sample_ids=ids,
                    token_sha1=digests,
                    loss_sum=values[0],
                    num_tokens=int(values[1]),
                    sample_losses=values[3:],
                    lm_loss_sum=values[2],
                )
            )
