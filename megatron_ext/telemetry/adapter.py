"""The telemetry feature in Megatron: per-bucket grad norms and the per-step signals log.

Flags: ``--log-bucket-grad-norms``, ``--signals-dir DIR``, ``--signals-update-ratio``. Hooks:

- ``on_setup``: keeps the DDP model chunks and the optimizer, and lays out this rank's bucket
  views (whole bucket under DDP, own shard under the distributed optimizer);
- ``before_grad_norm``: computes the squared bucket norms and launches ONE all-reduce for all
  of them (no host sync; the values are read after Megatron's own ``.item()`` on the norm);
- ``on_loss``: accumulates this rank's token-summed loss (worst DP rank);
- ``after_step``: builds the iteration's :class:`SignalRecord` (put on the step record for
  the spike detector), logs bucket norms to console/TensorBoard/W&B and checks Σ bucket²
  against Megatron's grad norm².
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
from megatron.training.utils import calc_params_l2_norm

from megatron_ext.features import Feature, FeatureError, LossInputs, StepRecord
from megatron_ext.telemetry.bucket_norms import BucketNormer, BucketView, bucket_name, clip_range
from megatron_ext.telemetry.signals import SignalRecord, SignalsWriter

# Σ bucket² must equal grad-norm² to this relative tolerance (fp32 summation-order noise).
NORM_CHECK_RTOL = 1e-5


def _is_writer() -> bool:
    """The last rank writes the signals (it holds the last stage's losses)."""
    return dist.get_rank() == dist.get_world_size() - 1


class TelemetryFeature(Feature):
    """Bucket grad norms, the worst DP rank's loss, the update ratio and the signals log."""

    name = "telemetry"

    def __init__(self) -> None:
        self.args: Any = None
        self.model: list[Any] = []
        self.optimizer: Any = None
        self.normer: BucketNormer | None = None
        self.names: list[str] = []  # all pipeline stages' bucket names, in slot order
        self.offset = 0  # where this stage's buckets start in the slot vector
        self.pending: torch.Tensor | None = None
        self.snapshot: list[torch.Tensor] | None = None
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

    def _layout_buckets(self) -> None:
        names_of = {param: name for chunk in self.model for name, param in chunk.named_parameters()}
        views: list[BucketView] = []
        for chunk in self.model:
            for group in [*chunk.bucket_groups, *chunk.expert_parallel_bucket_groups]:
                sharded = group.ddp_config.use_distributed_optimizer
                size = group.intra_distributed_optimizer_instance_size if sharded else 1
                rank = group.intra_distributed_optimizer_instance_rank if sharded else 0
                for bucket in group.buckets:
                    shard = bucket.grad_data.numel() // size
                    lo, hi = rank * shard, (rank + 1) * shard
                    ordered = sorted(bucket.params_list, key=lambda p: bucket.param_to_index[p])
                    segments = tuple(
                        bucket.grad_data[r[0] : r[1]]
                        for p in ordered
                        if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)
                        if (r := clip_range(*bucket.param_to_index[p], lo, hi)) is not None
                    )
                    views.append(
                        BucketView(
                            name=bucket_name(len(views), [names_of[p] for p in ordered]),
                            segments=segments,
                        )
                    )
        self.normer = BucketNormer(views)
        # Each pipeline stage owns different buckets: give every stage its own slots so ONE
        # all-reduce over the grad-stats group (TP x PP [x DP]) carries all of them.
        stages = mpu.get_pipeline_model_parallel_world_size()
        stage_names: list[list[str]] = [[] for _ in range(stages)]
        dist.all_gather_object(
            stage_names, [v.name for v in views], group=mpu.get_pipeline_model_parallel_group()
        )
        stage = mpu.get_pipeline_model_parallel_rank()
        self.offset = sum(len(n) for n in stage_names[:stage])
        self.names = [
            f"pp{s}.{n}" if len(stage_names) > 1 else n
            for s, names in enumerate(stage_names)
            for n in names
        ]

    # -- before_grad_norm ---------------------------------------------------------------
    def before_grad_norm(self, optimizer: Any) -> None:
        """Grads are reduced and not yet clipped."""
        if optimizer is not self.optimizer:
            return
        if self.normer is not None:
            local = self.normer()
            slots = torch.zeros(len(self.names), dtype=torch.float64, device=local.device)
            # fp16: grad_data holds scaled grads; the loss scale stays a tensor (no host sync).
            scale = torch.as_tensor(optimizer.get_loss_scale()).to(local.device, torch.float64)
            slots[self.offset : self.offset + len(local)] = local / (scale * scale)
            dist.all_reduce(slots, group=optimizer.get_grad_stats_parallel_group())
            self.pending = slots
        if self.args.signals_update_ratio:
            self.snapshot = [p.detach().float().clone() for p in self._counted_params()]

    def _counted_params(self) -> list[torch.Tensor]:
        """This rank's optimizer (main) parameters that the global norms count once."""
        return [
            p
            for opt in self.optimizer.chained_optimizers
            for p in opt.get_parameters()
            if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)
        ]

    # -- on_loss ------------------------------------------------------------------------
    def on_loss(self, inputs: LossInputs) -> dict[str, Any]:
        """Accumulate this rank's token-summed training loss of the iteration (no sync)."""
        if inputs.micro_batch.training and self.args.signals_dir:
            self.loss_sum = self.loss_sum + inputs.loss.detach().float()
            self.loss_tokens = self.loss_tokens + inputs.num_tokens.detach().float()
        return {}

    # -- after_step ---------------------------------------------------------------------
    def _update_ratio(self) -> float | None:
        """||Δθ|| / ||θ|| over the whole model: fused per-tensor norms, one all-reduce."""
        if self.snapshot is None:
            return None
        params = [p.detach().float() for p in self._counted_params()]
        device = params[0].device if params else torch.device("cpu")
        sums = torch.zeros(2, dtype=torch.float64, device=device)
        if params:
            deltas = torch._foreach_sub(params, self.snapshot)
            for row, tensors in enumerate((deltas, params)):
                sums[row] = torch.stack(torch._foreach_norm(tensors)).double().square().sum()
        dist.all_reduce(sums, group=self.optimizer.get_grad_stats_parallel_group())
        self.snapshot = None
        delta, norm = sums.tolist()
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
        bucket_sq = self.pending.tolist() if self.pending is not None else []
        self.pending = None
        buckets = {n: math.sqrt(max(s, 0.0)) for n, s in zip(self.names, bucket_sq)}
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
