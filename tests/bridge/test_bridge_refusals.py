"""What the Bridge integration refuses at start-up, with the reason, on real Bridge configs
(no launch: the refusals come before Bridge's pretrain starts anything); and the Transformer
Engine stand-in is seen by no module but the one that needs it."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from megatron_ext.bridge import args as bridge_args
from megatron_ext.bridge import te_standin
from tests.support.bridge_example import example_config


def test_the_te_stand_in_is_shown_only_to_lora_layers() -> None:
    te_standin.install()
    import megatron.bridge.peft.lora_layers as lora_layers

    assert lora_layers.te.__class__.__name__ == "_StandIn"
    assert importlib.util.find_spec("transformer_engine") is None  # nobody else sees it
    with pytest.raises(te_standin.TransformerEngineAbsent, match="not installed"):
        lora_layers.te.Linear()


def test_in_process_restart_is_refused_with_the_reason(tmp_path: Path) -> None:
    from megatron.bridge.training.config import InProcessRestartConfig

    config = example_config(tmp_path)
    config.inprocess_restart = InProcessRestartConfig(enabled=True)
    with pytest.raises(bridge_args.BridgeRefusal, match="rollback never reaches the supervisor"):
        bridge_args.refuse_unsupported(config)


def test_z_loss_and_the_fused_output_loss_with_bridges_fused_cross_entropy_are_accepted(
    tmp_path: Path,
) -> None:
    """z-loss composes with the native fused CE and routes TE's (docs/z-loss.md); the fused
    output loss, which replaces the CE, takes the fusion's place."""
    from megatron_ext.zloss.adapter import ZLossFeature

    config = example_config(tmp_path)
    for impl in ("native", "te"):
        config.model = dataclasses.replace(
            config.model, cross_entropy_loss_fusion=True, cross_entropy_fusion_impl=impl
        )
        args = bridge_args.megatron_args(config, ["--z-loss-coeff", "1e-4", "--log-output-z"])
        ZLossFeature().validate(args)
        assert (args.cross_entropy_loss_fusion, args.cross_entropy_fusion_impl) == (True, impl)
    args = bridge_args.megatron_args(config, ["--z-loss-coeff", "1e-4", "--fused-output-loss"])
    ZLossFeature().validate(args)
    assert args.fused_output_loss and args.cross_entropy_loss_fusion
    args = bridge_args.megatron_args(config, ["--signals-dir", str(tmp_path)])
    assert (args.save, args.train_iters, args.data_parallel_size) == (
        str(tmp_path / "ckpt"), 4, 1,
    )  # fmt: skip


def test_megatrons_own_flags_which_bridge_would_ignore_are_refused(tmp_path: Path) -> None:
    """Megatron's parser accepts its own flags, but Bridge trains what the ConfigContainer says:
    they are refused, naming them, not silently ignored; the launchers' flags stay accepted."""
    config = example_config(tmp_path)
    for flags, named in (
        (["--micro-batch-size", "7", "--spike-detect"], "--micro-batch-size:"),
        (["--lr=0.5", "--train-iters", "99"], "--train-iters, --lr:"),
    ):
        with pytest.raises(bridge_args.BridgeRefusal, match=f"{named} Megatron's own flags"):
            bridge_args.megatron_args(config, flags)
    assert (config.train.micro_batch_size, config.train.train_iters) == (2, 4)
    launchers = ["--save", str(tmp_path), "--load", str(tmp_path), "--exit-signal-handler"]
    launchers += ["--result-rejected-tracker-filename", "t", "--iterations-to-skip", "3"]
    args = bridge_args.megatron_args(config, [*launchers, "--signals-dir", str(tmp_path)])
    assert (args.micro_batch_size, args.iterations_to_skip) == (2, [3])


def test_a_forward_step_whose_loss_mask_cannot_be_read_is_refused() -> None:
    """The user's Bridge step must return its loss as ``partial(loss_func, loss_mask, ...)``
    (Bridge's gpt_step) or with ``loss_mask=`` (its distillation loss): the per-sample,
    per-source and worst-rank losses read that mask. Anything else is refused in one line; a
    mask of None (a pipeline stage without the loss) passes through unobserved."""
    import torch

    from megatron_ext.bridge import wiring
    from megatron_ext.common.errors import StartupError
    from megatron_ext.common.features import FeatureSet

    features = FeatureSet(argparse.Namespace(curr_iteration=0), ())
    model = torch.nn.Linear(2, 2)

    def loss_func(loss_mask: Any, output: torch.Tensor) -> tuple:
        return output.sum(), loss_mask.sum(), {}

    def step_returning(loss: Any) -> Any:
        def own_step(data_iterator: Any, model: Any) -> tuple:
            return torch.zeros(4), loss

        return own_step

    def forward(loss: Any) -> Any:
        return wiring.forward_step(features, step_returning(loss), False, None, None, model)[1]

    for unreadable in (lambda output: (output.sum(), 1, {}), partial(loss_func, [1, 1])):
        with pytest.raises(StartupError, match="'own_step' returns a loss function whose loss"):
            forward(unreadable)
    unobserved = partial(loss_func, None)
    assert forward(unobserved) is unobserved
    mask = torch.ones(4)
    for readable in (partial(loss_func, mask), partial(loss_func, loss_mask=mask)):
        observed = forward(readable)
        assert (observed.func, observed.args[2:]) == (wiring.observed_loss, (readable, mask))


def test_a_virtual_pipeline_over_two_stages_needs_overlapped_p2p(tmp_path: Path) -> None:
    """Megatron's validate_args refuses a virtual pipeline over 2 stages without overlapped
    P2P; Bridge's model config defaults to it (unless a comm_overlap config sets it) and the
    interleaved schedule then trains wrong gradients: refused, saying what to set."""
    from megatron.bridge.training.comm_overlap import CommOverlapConfig

    config = example_config(tmp_path)
    model = config.model
    model.pipeline_model_parallel_size, model.virtual_pipeline_model_parallel_size = 2, 2
    with pytest.raises(bridge_args.BridgeRefusal, match=r"Set model.overlap_p2p_comm=True and"):
        bridge_args.refuse_unsupported(config)
    model.overlap_p2p_comm, model.batch_p2p_comm = True, False
    bridge_args.refuse_unsupported(config)
    model.overlap_p2p_comm, model.batch_p2p_comm = False, True
    config.comm_overlap = CommOverlapConfig(tp_comm_overlap=False)  # Bridge sets it then
    bridge_args.refuse_unsupported(config)
    config.comm_overlap = CommOverlapConfig(tp_comm_overlap=False, overlap_p2p_comm=False)
    with pytest.raises(bridge_args.BridgeRefusal, match=r"Set model.overlap_p2p_comm=True and"):
        bridge_args.refuse_unsupported(config)
    config.comm_overlap, model.pipeline_model_parallel_size = None, 4  # Megatron's PP > 2
    bridge_args.refuse_unsupported(config)
