"""The weight-decay feature on real megatron-core objects, in process: the overrides it adds to
Megatron's standard ones give every parameter group of ``get_megatron_optimizer`` the intended
``wd_mult``; ``on_model_built`` refuses a GLOB that matches no parameter of a real GPTModel;
the start-up map names each parameter's rule."""

from __future__ import annotations

import pytest

from megatron_ext.common.features import FeatureError
from megatron_ext.weight_decay.adapter import (
    WeightDecayFeature,
    extend_overrides,
    report_param_groups,
)
from megatron_ext.weight_decay.core import policy_from_values, strip_wrappers
from tests.support import megatron_world as mw

FLAGS = {
    "embedding_weight_decay_mult": 0.0,
    "output_layer_weight_decay_mult": 0.5,
    "weight_decay_override": ["*.linear_fc1.weight=2", "decoder.layers.1.*=0.25"],
    "untie_embeddings_and_output_weights": True,
}


@pytest.fixture(scope="module")
def world():
    with mw.megatron_world(), mw.patches_undone():
        yield


def _policy():
    return policy_from_values(
        FLAGS["embedding_weight_decay_mult"],
        FLAGS["output_layer_weight_decay_mult"],
        FLAGS["weight_decay_override"],
        tied=False,
    )


def _intended(name: str, param) -> float:
    """Megatron's rule first (no decay for 1-D params and biases), then the policy."""
    if len(param.shape) == 1 or name.endswith(".bias"):
        return 0.0
    return _policy().resolve(name).mult


def test_param_groups_get_the_intended_wd_mult(world, capsys) -> None:
    from megatron.core.optimizer import OptimizerConfig, get_standard_config_overrides

    chunk = mw.ddp(mw.tiny_gpt())
    standard = get_standard_config_overrides(OptimizerConfig(optimizer="adam", lr=1e-3))
    overrides = extend_overrides(standard, _policy())
    optimizer = mw.optimizer([chunk], overrides=overrides)

    names = {p: strip_wrappers(n) for n, p in chunk.named_parameters()}
    found = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            found[names[param]] = group["wd_mult"]
    intended = {
        strip_wrappers(n): _intended(strip_wrappers(n), p) for n, p in chunk.named_parameters()
    }
    assert found == intended
    # Every rule is exercised: role flags, both GLOBs (the later wins), Megatron's, default 1.
    assert found["embedding.word_embeddings.weight"] == 0.0
    assert found["output_layer.weight"] == 0.5
    assert found["decoder.layers.0.mlp.linear_fc1.weight"] == 2.0
    assert found["decoder.layers.1.mlp.linear_fc1.weight"] == 0.25
    assert found["decoder.layers.0.self_attention.linear_proj.weight"] == 1.0
    assert found["decoder.final_layernorm.weight"] == 0.0

    report_param_groups([chunk], overrides, 0.1, _policy())
    out = capsys.readouterr().out
    assert "megatron-ext weight decay per parameter = --weight-decay 0.1 x wd_mult" in out
    assert "pp0 decoder.layers.1.mlp.linear_fc1.weight wd_mult=0.25 <- " in out
    assert "pp0 decoder.final_layernorm.weight wd_mult=0 <- Megatron" in out


def test_on_model_built_refuses_a_glob_that_matches_nothing(world) -> None:
    model = [mw.tiny_gpt()]
    feature = WeightDecayFeature()
    feature.install(mw.args(**FLAGS))
    feature.on_model_built(model)  # every GLOB matches: nothing to say

    typo = {**FLAGS, "weight_decay_override": ["*.linear_fc1.weight=2", "*.wieght=0"]}
    feature = WeightDecayFeature()
    feature.install(mw.args(**typo))
    with pytest.raises(FeatureError, match=r"'\*\.wieght=0' matches no parameter"):
        feature.on_model_built(model)


def _bridge_checkpoint(root, saved_args: dict | None) -> None:
    """The files of a Megatron-Bridge checkpoint at step 3 the resume check reads: Bridge's
    tracker, run_config.yaml and train_state.pt, and the overlay's layout file."""
    import json

    import torch
    import yaml

    from megatron_ext.common.files import (
        BRIDGE_LAYOUT_FILE,
        BRIDGE_RUN_CONFIG_FILE,
        BRIDGE_TRACKER_FILE,
        BRIDGE_TRAIN_STATE_FILE,
        checkpoint_dir,
    )

    state = {k: torch.tensor(v) for k, v in (("step", 3), ("consumed_train_samples", 24))}
    state["skipped_train_samples"] = torch.tensor(0)
    directory = checkpoint_dir(root, 3)
    directory.mkdir(parents=True)
    torch.save(state, directory / BRIDGE_TRAIN_STATE_FILE)
    torch.save(state, root / BRIDGE_TRACKER_FILE)
    model = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "seq_length": 64}
    config = {"model": model, "dataset": {}, "train": {}, "checkpoint": {"save": str(root)}}
    (directory / BRIDGE_RUN_CONFIG_FILE).write_text(yaml.safe_dump(config))
    layout = {"world_size": 2, "data_parallel_size": 2}
    if saved_args is not None:
        layout["args"] = saved_args
    (directory / BRIDGE_LAYOUT_FILE).write_text(json.dumps(layout))


def test_a_bridge_checkpoints_weight_decay_flags_are_checked_on_resume(tmp_path) -> None:
    """Under Bridge the flags come from the overlay's layout file (Bridge saves no Megatron
    args): the same policy passes, another is refused; a layout file without them (written
    before they were saved) and an unreadable tracker (Bridge's load reports it) pass."""
    from argparse import Namespace

    from megatron_ext.common.files import BRIDGE_TRACKER_FILE
    from megatron_ext.weight_decay.adapter import check_resume_compatible, policy_from_args
    from megatron_ext.weight_decay.core import WeightDecayResumeError

    saved = dict(
        embedding_weight_decay_mult=0.0,
        output_layer_weight_decay_mult=None,
        weight_decay_override=["*.linear_fc2.weight=0.5"],
        untie_embeddings_and_output_weights=True,
    )
    run = Namespace(load=str(tmp_path), no_load_optim=False, finetune=False, **saved)
    _bridge_checkpoint(tmp_path, saved)
    check_resume_compatible(run, policy_from_args(run))
    other = Namespace(**{**vars(run), "embedding_weight_decay_mult": 0.1})
    with pytest.raises(WeightDecayResumeError, match="iter_0000003 was trained with"):
        check_resume_compatible(other, policy_from_args(other))
    (tmp_path / BRIDGE_TRACKER_FILE).write_bytes(b"not a torch file")
    check_resume_compatible(other, policy_from_args(other))
    older = tmp_path / "older"
    _bridge_checkpoint(older, None)
    other.load = str(older)
    check_resume_compatible(other, policy_from_args(other))
