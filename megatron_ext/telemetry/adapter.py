"""The telemetry feature in Megatron: per-bucket grad norms and the per-step signals log.

Flags: ``--log-bucket-grad-norms``, ``--signals-dir DIR``, ``--signals-update-ratio``. Hooks:

- ``on_setup``: keeps the DDP model chunks and the optimizer, and lays out this rank's bucket
  views (whole bucket under DDP, own shard under the distributed optimizer);
- ``before_grad_norm``: computes the squared bucket norms and launches one all-reduce per
  grad-stats group (no host sync; the values are read after Megatron's own ``.item()`` on the
  norm);
- ``on_loss``: accumulates this rank's token-summed lm loss (worst DP rank);
- ``after_step``: builds the iteration's :class:`SignalRecord` (put on the step record for
  the spike detector), logs bucket norms to console/TensorBoard/W&B and checks Σ bucket²
  against Megatron's grad norm².

Reductions follow Megatron's grad norm: each chained optimizer reduces its parameters' norm
over its own grad-stats group (TP x PP for dense parameters under DDP; expert TP x EP x PP
for MoE experts; the whole distributed-optimizer instance with ``--use-distributed-optimizer``)
and the chain adds the squares. Dense and expert buckets are reduced over those groups, so
expert buckets are counted once per expert-parallel rank, not once per expert-DP replica.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import mpu
from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared
from megatron.training import get_tensorboard_writer, get_wandb_writer
from megatron.training.utils import calc_params_l2_norm

from megatron_ext.features import LM_LOSS_PER_TOKEN, Feature, FeatureError, LossInputs, StepRecord
from megatron_ext.telemetry.bucket_norms import (
    BucketNormer,
    BucketView,
    bucket_name,
    clip_range,
    global_layer_name,
    layer_paths,
)
from megatron_ext.telemetry.signals import SignalRecord, SignalsWriter
from megatron_ext.validation import check_directory

# Σ bucket² must equal grad-norm² to this relative tolerance (fp32 summation-order noise).
NORM_CHECK_RTOL = 1e-5


def _is_writer() -> bool:
    """The last rank writes the signals (it holds the last stage's losses)."""
    return dist.get_rank() == dist.get_world_size() - 1


def _is_expert(param: torch.Tensor) -> bool:
    """Megatron marks expert-parallel parameters ``allreduce=False`` (reduced over expert DP);
    the optimizer copies the mark onto its main parameters."""
    return not getattr(param, "allreduce", True)


def _counted(param: torch.Tensor, optimizer: Any) -> bool:
    """Whether Megatron's grad norm counts ``param`` on this rank (its own filter)."""
    return param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(
        param,
        tp_group=getattr(optimizer, "tp_group", None),
        expert_tp_group=getattr(optimizer, "expert_tp_group", None),
    )


@dataclass
class _Reduction:
    """Bucket slots all-reduced over one grad-stats group: every owner's buckets, in order.

    ``parts`` places this rank's buckets: (first local bucket, count, first slot).
    """

    group: Any
    names: list[str]
    parts: list[tuple[int, int, int]]


def _gather_slots(
    names: list[str], owner: tuple[int, ...], label: str, group: Any
) -> tuple[list[str], int]:
    """Every owner's bucket names over ``group`` and where this rank's start.

    An owner is what holds a distinct set of buckets (a pipeline stage; for experts, a
    stage and an expert-parallel rank). Ranks of one owner (TP peers, distributed-optimizer
    shards, expert-DP replicas under DDP) share its slots: the all-reduce sums their parts.
    """
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (owner, label, names), group=group)
    by_owner: dict[tuple[int, ...], tuple[str, list[str]]] = {}
    for key, prefix, found in gathered:
        if by_owner.setdefault(tuple(key), (prefix, found)) != (prefix, found):
            raise RuntimeError(
                f"megatron-ext telemetry: ranks of {prefix or 'one stage'} disagree on its "
                "gradient buckets; re-verify megatron_ext.telemetry.adapter"
            )
    order = sorted(by_owner)
    offset = sum(len(by_owner[o][1]) for o in order[: order.index(owner)])
    return [prefix + n for o in order for prefix, found in [by_owner[o]] for n in found], offset


class TelemetryFeature(Feature):
    """Bucket grad norms, the worst DP rank's loss, the update ratio and the signals log."""

    name = "telemetry"

    def __init__(self) -> None:
        self.args: Any = None
        self.model: list[Any] = []
        self.optimizer: Any = None
        self.normer: BucketNormer | None = None
        self.reductions: list[_Reduction] = []
        self.pending: list[torch.Tensor] = []
        self.snapshot: list[list[torch.Tensor]] | None = None
        self.loss_sum: torch.Tensor | float = 0.0
        self.loss_tokens: torch.Tensor | float = 0.0
        self.writer: SignalsWriter | None = None

    def add_args(self, group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--log-bucket-grad-norms",
            action="store_true",
            help="Log the L2 norm of every DDP gradient bucket's reduced, "
            "pre-clip gradient each step (console at --log-interval, "
            "TensorBoard key bucket-grad-norm/<name>, W&B, signals log).",
        )
        group.add_argument(
            "--signals-dir",
            type=str,
            default=None,
            help="Append one JSON line per iteration to DIR/signals.jsonl "
            "(written by the last rank every step): losses, worst DP rank, "
            "grad/bucket/params norms, lr, loss scale, zeros, flags, job id "
            "and attempt.",
        )
        group.add_argument(
            "--signals-update-ratio",
            action="store_true",
            help="Also record ||Δθ||/||θ|| per step. Keeps an fp32 copy of "
            "this rank's optimizer parameters (1/DP of them with the "
            "distributed optimizer), hence opt-in.",
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

    # -- on_setup -----------------------------------------------------------------------
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

    def _grad_stats_groups(self) -> dict[bool, Any]:
        """The group Megatron reduces each kind of parameter's norm over (expert: True)."""
        groups: dict[bool, Any] = {}
        for opt in self.optimizer.chained_optimizers:
            for param in opt.get_parameters():
                groups.setdefault(_is_expert(param), opt.get_grad_stats_parallel_group())
        if self.args.num_experts and True not in groups:
            raise RuntimeError(
                "megatron-ext --log-bucket-grad-norms: this pipeline stage has no expert "
                "parameters while the model has experts; bucket norms need MoE layers on "
                "every stage"
            )
        return groups

    def _bucket_views(self) -> dict[bool, list[BucketView]]:
        """This rank's dense and expert bucket views, named with global layer numbers."""
        views: dict[bool, list[BucketView]] = {False: [], True: []}
        part = self.optimizer.chained_optimizers[0]  # every part carries the same TP groups
        for chunk in self.model:
            paths = layer_paths(chunk.named_modules())
            names_of = {p: global_layer_name(n, paths) for n, p in chunk.named_parameters()}
            kinds = ((False, chunk.bucket_groups), (True, chunk.expert_parallel_bucket_groups))
            for expert, bucket_groups in kinds:
                for group in bucket_groups:
                    sharded = group.ddp_config.use_distributed_optimizer
                    size = group.intra_distributed_optimizer_instance_size if sharded else 1
                    rank = group.intra_distributed_optimizer_instance_rank if sharded else 0
                    for bucket in group.buckets:
                        shard = bucket.grad_data.numel() // size
                        lo, hi = rank * shard, (rank + 1) * shard
                        ordered = sorted(bucket.params_list, key=lambda p: bucket.param_to_index[p])
                        if not any(map(param_is_not_shared, ordered)):
                            continue  # only a shared copy: its gradient is counted elsewhere
                        segments = tuple(
                            bucket.grad_data[r[0] : r[1]]
                            for p in ordered
                            if _counted(p, part)
                            if (r := clip_range(*bucket.param_to_index[p], lo, hi)) is not None
                        )
                        name = bucket_name(len(views[expert]), [names_of[p] for p in ordered])
                        views[expert].append(BucketView(name=name, segments=segments))
        return views

    def _layout_buckets(self) -> None:
        views = self._bucket_views()
        groups = self._grad_stats_groups()
        self.normer = BucketNormer([*views[False], *views[True]])
        stage = mpu.get_pipeline_model_parallel_rank()
        staged = mpu.get_pipeline_model_parallel_world_size() > 1
        first_local = 0
        for expert in sorted(groups):
            owner = (stage, mpu.get_expert_model_parallel_rank()) if expert else (stage,)
            label = (f"pp{stage}." if staged else "") + (f"ep{owner[-1]}." if expert else "")
            names, offset = _gather_slots(
                [v.name for v in views[expert]], owner, label, groups[expert]
            )
            reduction = next((r for r in self.reductions if r.group is groups[expert]), None)
            if reduction is None:
                reduction = _Reduction(groups[expert], [], [])
                self.reductions.append(reduction)
            count = len(views[expert])
            reduction.parts.append((first_local, count, len(reduction.names) + offset))
            reduction.names += names
            first_local += count

    # -- before_grad_norm ---------------------------------------------------------------
    def before_grad_norm(self, optimizer: Any) -> None:
        """Grads are reduced and not yet clipped."""
        if optimizer is not self.optimizer:
            return
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
            self.snapshot = [[p.detach().float().clone() for p in ps] for _, ps in self._params()]

    def _params(self) -> list[tuple[Any, list[torch.Tensor]]]:
        """This rank's optimizer (main) parameters that the global norms count once, per
        grad-stats group (dense and expert parameters may reduce over different groups)."""
        sets: list[tuple[Any, list[torch.Tensor]]] = []
        for opt in self.optimizer.chained_optimizers:
            group = opt.get_grad_stats_parallel_group()
            params = [p for p in opt.get_parameters() if _counted(p, opt)]
            found = next((ps for g, ps in sets if g is group), None)
            if found is None:
                sets.append((group, params))
            else:
                found.extend(params)
        return sets

    # -- on_loss ------------------------------------------------------------------------
    def on_loss(self, inputs: LossInputs) -> dict[str, Any]:
        """Accumulate this rank's token-summed lm loss of the iteration (no sync): the loss
        ``lm loss`` averages, without a z-loss term, so the two can be compared."""
        if inputs.micro_batch.training and self.args.signals_dir:
            per_token = inputs.micro_batch.extras.get(LM_LOSS_PER_TOKEN)
            loss = inputs.loss.detach().float()
            if per_token is not None:
                loss = torch.sum(per_token.reshape(-1).float() * inputs.mask)
            self.loss_sum = self.loss_sum + loss
            self.loss_tokens = self.loss_tokens + inputs.num_tokens.detach().float()
        return {}

    # -- after_step ---------------------------------------------------------------------
    def _update_ratio(self) -> float | None:
        """||Δθ|| / ||θ|| over the whole model: fused per-tensor norms, one all-reduce per
        grad-stats group."""
        if self.snapshot is None:
            return None
        delta = norm = 0.0
        for (group, params), before in zip(self._params(), self.snapshot):
            current = [p.detach().float() for p in params]
            device = current[0].device if current else torch.device("cpu")
            sums = torch.zeros(2, dtype=torch.float64, device=device)
            if current:
                deltas = torch._foreach_sub(current, before)
                for row, tensors in enumerate((deltas, current)):
                    sums[row] = torch.stack(torch._foreach_norm(tensors)).double().square().sum()
            dist.all_reduce(sums, group=group)
            delta, norm = delta + sums[0].item(), norm + sums[1].item()
        self.snapshot = None
        return math.sqrt(delta) / math.sqrt(norm) if norm > 0 else None

    def _worst_rank(self) -> tuple[float | None, int | None]:
        if not mpu.is_pipeline_last_stage() or not torch.is_tensor(self.loss_tokens):
            return None, None
        local = (self.loss_sum / self.loss_tokens).reshape(1)
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
        update_ratio = self._update_ratio()
        params_norm = record.params_norm
        if self.args.signals_dir and params_norm is None:
            params_norm = calc_params_l2_norm(self.model)
        if not _is_writer():
            return
        self._log_buckets(record.iteration, buckets)
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
            params_norm=params_norm,
            update_ratio=update_ratio,
            lr=record.learning_rate,
            loss_scale=record.loss_scale,
            num_zeros=record.num_zeros,
            max_attention_logit=(
                record.max_attention_logit if self.args.log_max_attention_logit else None
            ),
            skipped_iter=record.skipped_iter,
            nan_iter=any(not math.isfinite(v) for v in losses.values()),
        )
        self.writer.write(record.signals)

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
        if not buckets:
            return
        writer, wandb = get_tensorboard_writer(), get_wandb_writer()
        for name, value in buckets.items():
            if writer is not None:
                writer.add_scalar(f"bucket-grad-norm/{name}", value, iteration)
        if wandb is not None:
            wandb.log({f"bucket-grad-norm/{n}": v for n, v in buckets.items()}, iteration)
        if iteration % self.args.log_interval == 0:
            shown = " | ".join(f"{n}: {v:.4g}" for n, v in buckets.items())
            print(f" iteration {iteration:8d} | bucket grad norms | {shown}", flush=True)
