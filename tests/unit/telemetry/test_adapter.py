"""The telemetry feature's hooks on real megatron-core objects (GPTModel, DDP buckets,
get_megatron_optimizer), in process: bucket views and norms equal a direct computation over
the parameters' gradients and Megatron's own grad norm, and the signals record is written."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron_ext.common.features import LossInputs, MicroBatch, StepRecord
from megatron_ext.common.files import SIGNALS_FILE
from megatron_ext.common.io import read_jsonl
from megatron_ext.telemetry.adapter import TelemetryFeature
from tests.support import megatron_world as mw


@pytest.fixture(scope="module")
def world():
    with mw.megatron_world():
        yield


def _args(signals_dir: Path) -> object:
    return mw.args(
        log_bucket_grad_norms=True,
        log_layer_norms=True,
        signals_dir=str(signals_dir),
        signals_update_ratio=True,
        num_experts=None,
        log_interval=1,
        consumed_train_samples=2,
        skipped_train_samples=0,
        log_max_attention_logit=False,
        signals_attention_logit=False,
        signals_by_dataset=True,
        straggler_factor=1.5,
        straggler_steps=5,
        straggler_min_seconds=0.0,
        data_path=None,
        data_args_path=None,
        train_data_path=None,
        valid_data_path=None,
        test_data_path=None,
        per_split_data_args_path=None,
    )


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["ddp", "distopt"])
def test_bucket_norms_equal_the_gradients_and_megatrons_grad_norm(
    world, tmp_path: Path, distributed_optimizer: bool
) -> None:
    chunk = mw.ddp(mw.tiny_gpt(), distributed_optimizer=distributed_optimizer)
    optimizer = mw.optimizer([chunk])
    feature = TelemetryFeature()
    feature.install(_args(tmp_path))
    feature.on_setup([chunk], optimizer)

    # Bucket views: every gradient element of the model exactly once, in bucket order.
    assert feature.normer is not None and len(feature.reductions) == 1
    names = [n for n in feature.reductions[0].names if not n.startswith("layer-")]
    assert len(names) == len(chunk.buffers[0].buckets) > 1, names
    assert [n.split(":")[0] for n in names] == [f"b{i}" for i in range(len(names))]
    assert any(n.startswith("b") and "[decoder.layers." in n for n in names), names

    loss = mw.backward(chunk, mw.batch())
    feature.before_grad_norm(optimizer)

    layers = _per_layer(chunk)
    before = {n: p.detach().clone() for n, p in chunk.module.named_parameters()}
    expected = {}
    for name, bucket in zip(names, chunk.buffers[0].buckets):
        squares = sum(p.main_grad.double().square().sum() for p in bucket.params_list)
        expected[name] = math.sqrt(float(squares))
    mask = torch.ones(loss.numel())
    feature.on_loss(
        LossInputs(MicroBatch(1, True, 0, True), loss, mask, loss.sum(), mask.sum().int())
    )
    updated, grad_norm, _ = optimizer.step()  # Megatron's own norm, after the hook
    assert updated
    record = StepRecord(
        iteration=1,
        losses={"lm loss": loss.mean()},
        learning_rate=1e-3,
        loss_scale=1.0,
        skipped_iter=False,
        grad_norm=grad_norm,
        params_norm=1.0,
        num_zeros=None,
        max_attention_logit=None,
    )
    feature.after_step(record)

    signals = record.signals
    assert signals is not None and set(signals.bucket_grad_norms) == set(expected)
    for name, value in expected.items():
        assert signals.bucket_grad_norms[name] == pytest.approx(value, rel=1e-6), name
    total = sum(v * v for v in signals.bucket_grad_norms.values())
    assert total == pytest.approx(grad_norm**2, rel=1e-5)
    assert signals.max_local_loss == pytest.approx(float(loss.mean()), rel=1e-6)
    assert signals.max_loss_dp_rank == 0
    assert signals.update_ratio is not None and 0 < signals.update_ratio < 1
    written = read_jsonl(tmp_path / SIGNALS_FILE).records
    assert [r["iteration"] for r in written] == [1]
    assert written[0]["bucket_grad_norms"] == pytest.approx(signals.bucket_grad_norms)
    # Per layer: each entry's gradient and (pre-step) weights, once, in model order.
    grads, weights = layers
    assert list(signals.layer_grad_norms) == list(grads), signals.layer_grad_norms
    assert signals.layer_grad_norms == pytest.approx(grads, rel=1e-6)
    assert signals.layer_param_norms == pytest.approx(weights, rel=1e-6)
    total = sum(v * v for v in signals.layer_grad_norms.values())
    assert total == pytest.approx(grad_norm**2, rel=1e-5)
    assert written[0]["layer_param_norms"] == pytest.approx(signals.layer_param_norms)
    # The step's update per layer, and with the weights after it, the update ratio.
    updates: dict[str, float] = {}
    for name, param in chunk.module.named_parameters():
        entry = ".".join(name.split(".")[:3]) if ".layers." in name else name.rpartition(".")[0]
        delta = float((param.detach().double() - before[name].double()).square().sum())
        updates[entry] = updates.get(entry, 0.0) + delta
    assert list(signals.layer_update_norms) == list(grads)
    assert signals.layer_update_norms == pytest.approx(
        {n: math.sqrt(v) for n, v in updates.items()}, rel=1e-5
    )
    after = sum(float(p.detach().double().square().sum()) for p in chunk.module.parameters())
    ratio = math.sqrt(sum(updates.values()) / after)
    assert signals.update_ratio == pytest.approx(ratio, rel=1e-5)


def _per_layer(chunk) -> tuple[dict[str, float], dict[str, float]]:
    """Each layer entry's gradient and weight norms, from the model's parameters by name."""
    grads: dict[str, float] = {}
    weights: dict[str, float] = {}
    for name, param in chunk.module.named_parameters():
        entry = name.split(".weight")[0].split(".bias")[0]
        if ".layers." in name:
            entry = ".".join(name.split(".")[:3])
        grads[entry] = grads.get(entry, 0.0) + float(param.main_grad.double().square().sum())
        weights[entry] = weights.get(entry, 0.0) + float(param.detach().double().square().sum())
    order = ["embedding.position_embeddings", "embedding.word_embeddings"]
    order += sorted((n for n in grads if ".layers." in n), key=lambda n: int(n.split(".")[2]))
    order += ["decoder.final_layernorm", "output_layer"]
    keep = [n for n in order if n in grads]
    assert set(keep) == set(grads), grads
    return (
        {n: math.sqrt(grads[n]) for n in keep},
        {n: math.sqrt(weights[n]) for n in keep},
    )


def test_a_foreign_optimizer_is_refused_at_setup(world, tmp_path: Path) -> None:
    chunk = mw.ddp(mw.tiny_gpt())
    feature = TelemetryFeature()
    feature.install(_args(tmp_path))
    with pytest.raises(RuntimeError, match="expects Megatron's ChainedOptimizer"):
        feature.on_setup([chunk], torch.optim.SGD(chunk.parameters(), lr=0.1))
