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
