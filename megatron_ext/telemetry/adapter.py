"""The telemetry feature in Megatron: per-bucket grad norms and the per-step signals log.

Flags ``--log-bucket-grad-norms``, ``--signals-dir``, ``--signals-update-ratio``. ``on_setup``
lays out this rank's buckets (:mod:`.bucket_layout`; FSDP2 units, :mod:`.sharded`);
``before_grad_norm`` launches the squared bucket norms' all-reduces (read after Megatron's own
``.item()`` on the norm); ``on_loss`` sums this rank's lm loss and, per blend member, its loss
and tokens (:mod:`.sources`); ``after_step`` builds the :class:`SignalRecord`, logs the bucket
norms and checks Σ bucket² against Megatron's grad norm². Under context parallelism the worst
DP rank's loss adds the CP ranks' sums first.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import mpu
from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared
from megatron.training import get_tensorboard_writer, get_wandb_writer
from megatron.training import training as megatron_training
from megatron.training.utils import get_blend_and_blend_per_split

from megatron_ext.common.features import (
    LM_LOSS_PER_TOKEN,
    Feature,
    FeatureError,
    LossInputs,
    StepRecord,
    is_writing_rank,
)
from megatron_ext.common.records.signals import SignalRecord, SignalsWriter
from megatron_ext.common.records.sources import member_names, train_blend
from megatron_ext.common.validation import check_directory
from megatron_ext.telemetry.bucket_layout import (
    BucketNormer,
    Reduction,
    assign_slots,
    bucket_views,
    grad_stats_groups,
    params_by_group,
)
from megatron_ext.telemetry.sharded import (
    UnitNormer,
    fsdp_units,
    is_fully_sharded,
    snapshot,
    update_ratio,
)
from megatron_ext.telemetry.sources import SourceAccumulator, format_sources

# Σ bucket² must equal grad-norm² to this relative tolerance (fp32 summation-order noise).
NORM_CHECK_RTOL = 1e-5


def _is_writer() -> bool:
    return is_writing_rank(dist.get_rank(), dist.get_world_size())


def train_members(args: Any) -> list[str]:
    """The names of this launch's train blend members (none with mock data), so a resume
    under another blend (a new stage) names its own."""
    return member_names(train_blend(*get_blend_and_blend_per_split(args)))


def _counted(param: torch.Tensor, optimizer: Any) -> bool:
    """Whether Megatron's grad norm counts ``param`` on this rank: its own filter with the
    optimizer part's groups (assumption ``optimizer-tp-groups``; ``expert_tp_group`` only
    where the part has one, as before megatron-core 0.19)."""
    try:
        groups = {"tp_group": optimizer.tp_group}
    except AttributeError as exc:
        raise RuntimeError(
            f"megatron-ext telemetry: {type(optimizer).__name__} has no {exc.name} (registry "
            "assumption optimizer-tp-groups); re-verify megatron_ext.telemetry.adapter"
        ) from None
    if hasattr(optimizer, "expert_tp_group"):
        groups["expert_tp_group"] = optimizer.expert_tp_group
    return param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param, **groups)


def step_lr(reported: float | None, now: list[float], before: list[float] | None) -> float | None:
    """The learning rate the step used. Megatron reports the next iteration's lr of its
    logging group, the first whose lr ``now`` is the reported one; ``before`` holds each
    group's lr as the step ran (None: an overflow skip, the schedule stood still)."""
    if reported is None or before is None:
        return reported
    for current, used in zip(now, before):
        if current == reported:
            return used
    return reported


class TelemetryFeature(Feature):
    """Bucket grad norms, the worst DP rank's loss, the update ratio and the signals log."""

    name = "telemetry"

    def __init__(self) -> None:
        self.args: Any = None
        self.model: list[Any] = []
        self.optimizer: Any = None
        self.normer: BucketNormer | UnitNormer | None = None
        self.reductions: list[Reduction] = []
        self.pending: list[torch.Tensor] = []
        self.snapshot: list[list[torch.Tensor]] | None = None
        self.loss_sum: torch.Tensor | float = 0.0
        self.loss_tokens: torch.Tensor | float = 0.0
        self.writer: SignalsWriter | None = None
        self.members: list[str] = []
        self.sources: SourceAccumulator | None = None
        self.step_lrs: list[float] | None = None  # each param group's lr as the step ran

    def add_args(self, group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--log-bucket-grad-norms",
            action="store_true",
            help="Log the L2 norm of every DDP gradient bucket's reduced, pre-clip gradient "
            "each step (console at --log-interval, TensorBoard key bucket-grad-norm/<name>, "
            "W&B, signals log).",
        )
        group.add_argument(
            "--signals-dir",
            type=str,
            default=None,
            help="Append one JSON line per iteration to DIR/signals.jsonl (written by the "
            "last rank every step): losses, worst DP rank, grad/bucket/params norms, lr, loss "
            "scale, zeros, flags, job id and attempt.",
        )
        group.add_argument(
            "--no-signals-by-dataset",
            dest="signals_by_dataset",
            action="store_false",
            help="Leave the per-source fields (lm_loss_by_dataset, tokens_by_dataset: each "
            "train blend member's loss and tokens) out of the signals, and their one small "
            "all-reduce per step (recorded by default with --signals-dir).",
        )
        group.add_argument(
            "--signals-update-ratio",
            action="store_true",
            help="Also record ||Δθ||/||θ|| per step. Keeps an fp32 copy of this rank's "
            "optimizer parameters (1/DP of them with the distributed optimizer), hence opt-in.",
        )

    def enabled(self, args: Any) -> bool:
        return bool(args.log_bucket_grad_norms or args.signals_dir or args.signals_update_ratio)

    def validate(self, args: Any) -> None:
        if args.signals_update_ratio and not args.signals_dir:
            raise FeatureError("--signals-update-ratio needs --signals-dir (it is a signals field)")
        if args.signals_dir:
            try:
                check_directory("--signals-dir", args.signals_dir)
            except ValueError as exc:
                raise FeatureError(str(exc)) from None

    def install(self, args: Any) -> None:
        self.args = args
        if args.signals_dir and args.signals_by_dataset:
            self.members = train_members(args)

    def on_setup(self, model: list[Any], optimizer: Any) -> None:
        from megatron.core.optimizer.optimizer import ChainedOptimizer

        if not isinstance(optimizer, ChainedOptimizer):
            raise RuntimeError(
                f"megatron-ext telemetry expects Megatron's ChainedOptimizer, got "
                f"{type(optimizer).__name__}; re-verify megatron_ext.telemetry.adapter"
            )
        self.model, self.optimizer = model, optimizer
        if self.args.log_bucket_grad_norms:
            self._layout_buckets()
        if self.args.signals_dir and _is_writer():
            self.writer = SignalsWriter(self.args.signals_dir)
        if self.members and mpu.is_pipeline_last_stage():
            device = next(p.device for chunk in model for p in chunk.parameters())
            self.sources = SourceAccumulator(self.members, device)

    def _layout_buckets(self) -> None:
        """Bucket views (FSDP2: ``fully_shard`` units) and their reduction slots."""
        part = self.optimizer.chained_optimizers[0]  # every part carries the same TP groups
        groups = grad_stats_groups(self.optimizer.chained_optimizers, bool(self.args.num_experts))
        if is_fully_sharded(self.model):
            parts = self.optimizer.chained_optimizers
            units, self.normer = fsdp_units(self.model, lambda p: _counted(p, part), parts)
            views = {False: units, True: []}
        else:
            views = bucket_views(self.model, lambda p: _counted(p, part), param_is_not_shared)
            self.normer = BucketNormer([*views[False], *views[True]])
        self.reductions = assign_slots(
            views,
            groups,
            stage=mpu.get_pipeline_model_parallel_rank(),
            staged=mpu.get_pipeline_model_parallel_world_size() > 1,
            expert_rank=mpu.get_expert_model_parallel_rank(),
        )

    def before_grad_norm(self, optimizer: Any) -> None:
        """Grads are reduced and not yet clipped: launch the bucket norms' all-reduces."""
        if optimizer is not self.optimizer:
            return
        self.step_lrs = [group["lr"] for group in optimizer.param_groups]
        if self.normer is not None:
            local = self.normer()
            # fp16: grad_data holds scaled grads; the loss scale stays a tensor (no host sync).
            scale = torch.as_tensor(optimizer.get_loss_scale()).to(local.device, torch.float64)
            local = local / (scale * scale)
            self.pending = []
            for reduction in self.reductions:
                slots = torch.zeros(len(reduction.names), dtype=torch.float64, device=local.device)
                for first, count, offset in reduction.parts:
                    slots[offset : offset + count] = local[first : first + count]
                dist.all_reduce(slots, group=reduction.group)
                self.pending.append(slots)
        if self.args.signals_update_ratio:
            self.snapshot = snapshot(self._params())

    def _params(self) -> list[tuple[Any, list[torch.Tensor]]]:
        """This rank's counted optimizer parameters per grad-stats group."""
        return params_by_group(self.optimizer.chained_optimizers, _counted)

    def on_loss(self, inputs: LossInputs) -> dict[str, Any]:
        """Accumulate this rank's token-summed lm loss (pure CE, as ``lm loss``; no sync)."""
        if inputs.micro_batch.training and self.args.signals_dir:
            per_token = inputs.micro_batch.extras.get(LM_LOSS_PER_TOKEN)
            loss = inputs.loss.detach().float()
            if per_token is not None:
                loss = torch.sum(per_token.reshape(-1).float() * inputs.mask)
            self.loss_sum = self.loss_sum + loss
            self.loss_tokens = self.loss_tokens + inputs.num_tokens.detach().float()
            if self.sources is not None and inputs.micro_batch.reads_data:
                lm = per_token if per_token is not None else inputs.per_token
                self.sources.add(lm.detach(), inputs.mask, inputs.micro_batch.dataset_ids)
        return {}

    def _worst_rank(self) -> tuple[float | None, int | None]:
        if not mpu.is_pipeline_last_stage() or not torch.is_tensor(self.loss_tokens):
            return None, None
        totals = torch.stack([torch.as_tensor(self.loss_sum), self.loss_tokens])
        if mpu.get_context_parallel_world_size() > 1:  # a CP rank's sums cover its sequence part
            dist.all_reduce(totals, group=mpu.get_context_parallel_group())
        local = (totals[0] / totals[1]).reshape(1)
        gathered = [torch.zeros_like(local) for _ in range(mpu.get_data_parallel_world_size())]
        dist.all_gather(gathered, local, group=mpu.get_data_parallel_group())
        values = torch.cat(gathered).tolist()
        worst = max(range(len(values)), key=lambda i: values[i])
        return values[worst], worst

    def after_step(self, record: StepRecord) -> None:
        names = [n for reduction in self.reductions for n in reduction.names]
        bucket_sq = [v for slots in self.pending for v in slots.tolist()]
        self.pending = []
        buckets = {n: math.sqrt(max(s, 0.0)) for n, s in zip(names, bucket_sq)}
        grad_norm = record.grad_norm
        if buckets and grad_norm is not None and math.isfinite(grad_norm):
            self._check(record.iteration, sum(bucket_sq), grad_norm)
        worst_loss, worst_rank = self._worst_rank()
        self.loss_sum, self.loss_tokens = 0.0, 0.0
        by_dataset: tuple[dict[str, float], dict[str, int]] = ({}, {})
        if self.sources is not None:  # the last stage; TP ranks > 0 add zeros
            group = mpu.get_tensor_and_data_parallel_group(with_context_parallel=True)
            by_dataset = self.sources.reduce(group)
        ratio = None if self.snapshot is None else update_ratio(self._params(), self.snapshot)
        self.snapshot = None
        params_norm = record.params_norm
        if self.args.signals_dir and params_norm is None:  # the patched one (FSDP2: global)
            params_norm = megatron_training.calc_params_l2_norm(self.model)
        if not _is_writer():
            return
        self._log_buckets(record.iteration, buckets)
        self._log_sources(record.iteration, *by_dataset)
        if self.writer is None:
            return
        args = self.args
        losses = {k: float(v) for k, v in record.losses.items()}
        record.signals = SignalRecord(
            iteration=record.iteration,
            attempt=0,
            job_id=os.environ.get("SLURM_JOB_ID", "local"),
            wall_time=time.time(),
            consumed_samples=int(args.consumed_train_samples),
            skipped_samples=int(args.skipped_train_samples),
            lm_loss=losses.get("lm loss"),
            z_loss=losses.get("z loss"),
            max_local_loss=worst_loss,
            max_loss_dp_rank=worst_rank,
            grad_norm=grad_norm,
            bucket_grad_norms=buckets,
            lm_loss_by_dataset=by_dataset[0],
            tokens_by_dataset=by_dataset[1],
            params_norm=params_norm,
            update_ratio=ratio,
            lr=step_lr(
                record.learning_rate,
                [group["lr"] for group in self.optimizer.param_groups],
                self.step_lrs,
            ),
            loss_scale=record.loss_scale,
            num_zeros=record.num_zeros,
            max_attention_logit=(
                record.max_attention_logit
                if self.args.log_max_attention_logit or self.args.signals_attention_logit
                else None
            ),
            skipped_iter=record.skipped_iter,
            nan_iter=any(not math.isfinite(v) for v in losses.values()),
            log_z=losses.get("log z"),
            update_skipped=record.update_skipped,
        )
        self.writer.write(record.signals)
        self.step_lrs = None

    def _check(self, iteration: int, bucket_sum_sq: float, grad_norm: float) -> None:
        expected = grad_norm * grad_norm
        if abs(bucket_sum_sq - expected) > NORM_CHECK_RTOL * max(expected, 1e-30):
            print(
                f"megatron-ext WARNING: iteration {iteration}: sum of bucket grad norms^2 "
                f"{bucket_sum_sq:.9g} != grad-norm^2 {expected:.9g} (rtol {NORM_CHECK_RTOL}); "
                "bucket norms do not cover what Megatron's grad norm covers",
                flush=True,
            )

    def _log_buckets(self, iteration: int, buckets: dict[str, float]) -> None:
        scalars = {f"bucket-grad-norm/{n}": v for n, v in buckets.items()}
        shown = " | ".join(f"{n}: {v:.4g}" for n, v in buckets.items())
        self._log(iteration, scalars, f"bucket grad norms | {shown}")

    def _log_sources(
        self, iteration: int, losses: dict[str, float], tokens: dict[str, int]
    ) -> None:
        scalars = {f"lm-loss-by-dataset/{n}": v for n, v in losses.items()}
        scalars |= {f"tokens-by-dataset/{n}": float(v) for n, v in tokens.items()}
        self._log(iteration, scalars, f"lm loss by dataset | {format_sources(losses, tokens)}")

    def _log(self, iteration: int, scalars: dict[str, float], line: str) -> None:
        """Scalars to TensorBoard and W&B, and ``line`` to the console at --log-interval."""
        if not scalars:
            return
        writer, wandb = get_tensorboard_writer(), get_wandb_writer()
        if writer is not None:
            for key, value in scalars.items():
                writer.add_scalar(key, value, iteration)
        if wandb is not None:
            wandb.log(scalars, iteration)
        if iteration % self.args.log_interval == 0:
            print(f" iteration {iteration:8d} | {line}", flush=True)
