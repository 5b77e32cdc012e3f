"""The public API for a pretrain script of the user's own (``megatron_ext.fork``), in process:
what its calls hand the features, the refusals that say which call to change, and the CPU
command that runs such a script. The whole script through the real loop, with every feature,
is tests/e2e/test_fork_example.py."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
import torch

from megatron_ext import train
from megatron_ext.common.features import Feature, FeatureSet, LossInputs, MicroBatch
from megatron_ext.fork import Forward, Overlay, ScriptError
from megatron_ext.fork.overlay import check_script
from tests.support.harness import REPO

EXAMPLE = REPO / "docs" / "examples" / "pretrain_gpt_fork.py"


class Recorder(Feature):
    """Sees every batch and loss; adds a training-only entry and replaces ``lm loss``."""

    def __init__(self) -> None:
        self.batches: list[tuple[dict[str, Any], MicroBatch]] = []
        self.losses: list[LossInputs] = []

    def on_batch(self, batch: dict[str, Any], micro_batch: MicroBatch) -> None:
        self.batches.append((batch, micro_batch))
        batch["tokens"] = batch["tokens"] + 1  # the drill may change the batch

    def on_loss(self, inputs: LossInputs) -> dict[str, Any]:
        self.losses.append(inputs)
        return {"lm loss": torch.tensor([1.0, 2.0]), "z loss": torch.tensor([3.0, 2.0])}

    def on_train_dataset(self, dataset: Any) -> Any:
        return ("wrapped", dataset)


def _forward(training: bool) -> tuple[Recorder, Forward]:
    recorder = Recorder()
    features = FeatureSet(argparse.Namespace(), (recorder,))
    return recorder, Forward(features, MicroBatch(iteration=3, training=training, dp_rank=1))


def _script_loss(output_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    loss = output_tensor.sum()
    return loss, torch.tensor(4), {"lm loss": torch.tensor([9.0, 4.0]), "mine": loss}


def test_read_gives_on_batch_the_loaders_batch_with_its_blend_member_ids() -> None:
    recorder, forward = _forward(training=True)
    ids = torch.tensor([0, 1])
    batch = forward.read(iter([{"tokens": torch.zeros(2, 3), "dataset_id": ids}]))
    assert forward.micro_batch.reads_data and forward.micro_batch.dataset_ids is ids
    assert recorder.batches[0][1] is forward.micro_batch
    assert batch["tokens"].eq(1).all()  # the script broadcasts what the features left


def test_loss_calls_the_scripts_loss_then_on_loss_with_the_per_token_loss_and_mask() -> None:
    recorder, forward = _forward(training=True)
    output = torch.ones(2, 2)
    loss, tokens, report = forward.loss(_script_loss, torch.tensor([[1, 0], [1, 1]]))(output)
    inputs = recorder.losses[0]
    assert inputs.per_token is output and inputs.loss is loss and inputs.num_tokens is tokens
    assert inputs.mask.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert set(report) == {"lm loss", "z loss", "mine"} and report["lm loss"].tolist() == [1, 2]
    # In evaluation the features add only what is a perplexity; the script's entries stay.
    _, forward = _forward(training=False)
    _, _, report = forward.loss(_script_loss, torch.ones(2, 2))(output)
    assert set(report) == {"lm loss", "mine"}


def test_a_loss_function_without_the_token_count_is_refused_with_the_contract() -> None:
    _, forward = _forward(training=True)
    with pytest.raises(ScriptError, match=r"must return \(token-summed loss, token count"):
        forward.loss(lambda output: (output.sum(), {}), torch.ones(1))(torch.ones(1))


def test_the_features_are_reachable_only_once_pretrain_installed_them() -> None:
    overlay = Overlay()
    with pytest.raises(ScriptError, match=r"call overlay.pretrain\(...\)"):
        overlay.forward(torch.nn.Linear(1, 1))
    features = FeatureSet(argparse.Namespace(), (Recorder(),))
    calls = []

    def provider(num_samples: list[int], vp_stage: int | None = None) -> tuple:
        calls.append(vp_stage)
        return "train", "valid", None

    provider.is_distributed = True  # type: ignore[attr-defined]
    step, datasets = overlay._bind(print, provider, features, print)
    assert step is print and overlay.features is features and datasets.is_distributed
    assert datasets([8, 0, 0]) == (("wrapped", "train"), "valid", None)
    datasets([8, 0, 0], vp_stage=1)
    assert calls == [None, 1]


def test_modes_whose_batch_the_features_cannot_read_are_refused() -> None:
    args = argparse.Namespace(sft=True, fim_data=False)
    with pytest.raises(ScriptError, match="--sft: megatron-ext's features read the standard"):
        check_script(args)


def test_train_cpu_runs_a_script_of_your_own_through_the_runner(monkeypatch) -> None:
    launched: list[list[str]] = []
    monkeypatch.setattr(train.subprocess, "call", lambda command: launched.append(command) or 0)
    assert train.main(["--cpu", "--script", str(EXAMPLE), "--", "--num-layers", "2"]) == 0
    runner = launched[0].index(str(train.CPU_RUNNER))
    assert launched[0][runner + 1 : runner + 3] == ["--script", str(EXAMPLE)]
    assert launched[0][runner + 3 :] == [*train.CPU_FLAGS, "--num-layers", "2"]
