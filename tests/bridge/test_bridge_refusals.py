"""What the Bridge integration refuses at start-up, with the reason, on real Bridge configs
(no launch: the refusals come before Bridge's pretrain starts anything); and the Transformer
Engine stand-in is seen by no module but the one that needs it."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
from pathlib import Path

import pytest

from megatron_ext.bridge import args as bridge_args
from megatron_ext.bridge import te_standin

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "pretrain_bridge.py"


def _config(tmp_path: Path):
    """The example script's real ConfigContainer."""
    te_standin.install()
    spec = importlib.util.spec_from_file_location("pretrain_bridge", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    options = argparse.Namespace(
        data_path=["prefix"], tokenizer=str(tmp_path), work=tmp_path, train_iters=4,
        save_interval=2, global_batch_size=8, micro_batch_size=2,
    )  # fmt: skip
    return module.config(options)


def test_the_te_stand_in_is_shown_only_to_lora_layers() -> None:
    te_standin.install()
    import megatron.bridge.peft.lora_layers as lora_layers

    assert lora_layers.te.__class__.__name__ == "_StandIn"
    assert importlib.util.find_spec("transformer_engine") is None  # nobody else sees it
    with pytest.raises(te_standin.TransformerEngineAbsent, match="not installed"):
        lora_layers.te.Linear()


def test_in_process_restart_is_refused_with_the_reason(tmp_path: Path) -> None:
    from megatron.bridge.training.config import InProcessRestartConfig

    config = _config(tmp_path)
    config.inprocess_restart = InProcessRestartConfig(enabled=True)
    with pytest.raises(bridge_args.BridgeRefusal, match="rollback never reaches the supervisor"):
        bridge_args.refuse_unsupported(config)


def test_z_loss_and_the_fused_output_loss_with_bridges_fused_cross_entropy_are_accepted(
    tmp_path: Path,
) -> None:
    """z-loss composes with the native fused CE and routes TE's (docs/z-loss.md); the fused
    output loss, which replaces the CE, takes the fusion's place."""
    from megatron_ext.zloss.adapter import ZLossFeature

    config = _config(tmp_path)
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
