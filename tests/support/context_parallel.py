"""One rank of the context-parallel check (``torchrun --nproc-per-node 2``, CPU, gloo): what the
sample log and telemetry record from sequence shards cut by megatron-core itself.

Megatron's parallel state is set up with CP=2 (DP=TP=PP=1); a micro-batch whose loss mask
differs between the sequence's parts (so the CP ranks hold unequal token counts) is cut with
megatron-core's ``get_batch_on_this_cp_rank`` (the zig-zag split the GPT step uses), and the
real :class:`SampleLogFeature` and :class:`TelemetryFeature` see this rank's shard and a
per-token loss that is a function of (label, position): the same loss the whole sequence
would have. Each rank writes what the features produced to ``OUT/rank<R>.json``; the sample
log goes to ``OUT/samples``. tests/unit/test_context_parallel.py compares them with the whole
sequence's values.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

BATCH, SEQ = 3, 16


def whole_batch() -> dict[str, torch.Tensor]:
    """The micro-batch every CP rank reads (each reads the whole of it, as in training)."""
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 100, (BATCH, SEQ + 1), generator=generator)
    mask = torch.ones(BATCH, SEQ)
    mask[0, :3] = 0  # chunk 0 of 4 (CP rank 0 holds chunks 0 and 3) loses 3 tokens
    mask[2, 9:11] = 0  # chunk 2 (CP rank 1 holds 1 and 2) loses 2
    return {
        "tokens": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "loss_mask": mask,
        "position_ids": torch.arange(SEQ).expand(BATCH, SEQ).clone(),
        "attention_mask": None,
        "sample_id": torch.arange(10, 10 + BATCH),
    }


def per_token_loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A loss per token that depends only on its label and position (as a model's would)."""
    return batch["labels"].float() * 0.01 + batch["position_ids"].float() * 0.001 + 1.0


def main(out: Path) -> None:
    from megatron_ext.cpu import shims

    shims.install()
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megatron_ext.common.features import LossInputs, MicroBatch, StepRecord
    from megatron_ext.sample_log.adapter import SampleLogFeature
    from megatron_ext.telemetry.adapter import TelemetryFeature
    from megatron_ext.telemetry.sources import SourceAccumulator
    from megatron_ext.telemetry.step_sums import StepSums
    from megatron_ext.telemetry.stragglers import StepClock

    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    rank = dist.get_rank()
    batch = whole_batch()
    shard = get_batch_on_this_cp_rank(
        {k: v for k, v in batch.items() if k != "sample_id"},
        is_hybrid_cp=False,
        cp_group=parallel_state.get_context_parallel_group(),
    )
    losses = per_token_loss(shard)
    mask = shard["loss_mask"].reshape(-1)
    inputs = LossInputs(
        MicroBatch(iteration=1, training=True, dp_rank=0, reads_data=True),
        losses,
        mask,
        torch.sum(losses.reshape(-1) * mask),
        mask.sum().to(torch.int),
    )
    sample_log = SampleLogFeature()
    sample_log.install(SimpleNamespace(sample_log_dir=str(out / "samples")))
    sample_log.on_batch(batch, inputs.micro_batch)
    sample_log.on_loss(inputs)
    sample_log.after_step(StepRecord(1, {}, None, 1.0, False, None, None, None, None))

    telemetry = TelemetryFeature()
    telemetry.args = SimpleNamespace(signals_dir=str(out / "signals"))
    telemetry.members = ["even", "odd"]
    telemetry.sources = SourceAccumulator(telemetry.members, "cpu")
    dp, world = parallel_state.get_data_parallel_world_size(), dist.get_world_size()
    telemetry.sums, telemetry.clock = StepSums(2, dp, world), StepClock(cuda=False)
    inputs.micro_batch.dataset_ids = torch.arange(BATCH) % 2
    telemetry.on_loss(inputs)
    # The one after-step all-reduce; every rank reads it here (in training, the writer).
    step = telemetry.sums.read(telemetry._reduce_after_step().tolist(), telemetry.members)
    worst_loss, worst_rank, by_source = step.worst_loss, step.worst_rank, step.by_dataset
    result = {
        "shard_tokens": int(mask.sum()),
        "worst_loss": worst_loss,
        "worst_rank": worst_rank,
        "loss_by_source": by_source[0],
        "tokens_by_source": by_source[1],
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
