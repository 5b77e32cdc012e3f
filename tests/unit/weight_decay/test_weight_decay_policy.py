"""Weight-decay multipliers: the policy (precedence, tied/PP/MTP names, validation, resume
comparison) and the Megatron overrides it produces (the real update: tests/e2e)."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.weight_decay.core import (
    EMBEDDING_WEIGHT,
    GlobUsage,
    Override,
    WeightDecayConfigError,
    WeightDecayPolicy,
    WeightDecayResumeError,
    check_resume,
    parse_override,
    policy_from_values,
)


def _policy(emb=None, out=None, overrides=(), tied=False) -> WeightDecayPolicy:
    return policy_from_values(emb, out, list(overrides), tied)


# --- the policy -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("*.linear_proj.weight=0.5", Override("*.linear_proj.weight", 0.5)),
        (" decoder.* = 0 ", Override("decoder.*", 0.0)),
        ("odd=name=2", Override("odd=name", 2.0)),
    ],
)
def test_parse_override(text: str, expected: Override) -> None:
    assert parse_override(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("decoder.*", "expected GLOB=MULT"),
        ("=0.5", "expected GLOB=MULT"),
        ("decoder.*=", "expected GLOB=MULT"),
        ("decoder.*=half", "'half' is not a number"),
        ("decoder.*=-1", "finite and >= 0"),
        ("decoder.*=nan", "finite and >= 0"),
    ],
)
def test_parse_override_rejects_with_a_clear_message(text: str, message: str) -> None:
    with pytest.raises(WeightDecayConfigError, match=message):
        parse_override(text)


def test_role_flags_validated() -> None:
    with pytest.raises(WeightDecayConfigError, match=r"--embedding-weight-decay-mult.*>= 0"):
        _policy(emb=-0.1)
    with pytest.raises(WeightDecayConfigError, match="--output-layer-weight-decay-mult"):
        _policy(out=float("inf"))


def test_no_flag_is_inactive_and_decides_nothing() -> None:
    policy = _policy()
    assert not policy.active
    assert policy.multipliers() == set()
    assert policy.resolve("module.module.embedding.word_embeddings.weight").mult == 1.0


def test_precedence_last_glob_then_role_then_default() -> None:
    policy = _policy(
        emb=0.0,
        out=0.25,
        overrides=["decoder.*=0.5", "*.linear_fc1.weight=2", "embedding.position_*=0.1"],
    )
    resolve = policy.resolve
    assert resolve("module.module.embedding.word_embeddings.weight").mult == 0.0
    assert "--embedding-weight-decay-mult" in resolve("embedding.word_embeddings.weight").source
    # Globs beat the role flag; learned position embeddings belong to the embedding role.
    assert resolve("embedding.position_embeddings.weight").mult == 0.1
    assert resolve("output_layer.weight").mult == 0.25
    assert resolve("decoder.layers.0.mlp.linear_fc2.weight").mult == 0.5
    # Both globs match linear_fc1: the later one wins.
    decision = resolve("module.decoder.layers.1.mlp.linear_fc1.weight")
    assert decision.mult == 2.0 and "*.linear_fc1.weight=2" in decision.source
    assert resolve("mtp.layers.0.eh_proj.weight").mult == 1.0
    assert policy.multipliers() == {0.0, 0.25, 0.5, 2.0, 0.1}


def test_tied_output_copy_is_the_embedding_for_every_rule() -> None:
    """PP>1 with tied weights: the last stage's output_layer.weight is a copy of the embedding
    whose grads are all-reduced with it; both copies must get one multiplier or they drift."""
    policy = _policy(emb=0.0, out=0.5, overrides=["embedding.*=0.3"], tied=True)
    first_stage = policy.resolve("module.module.embedding.word_embeddings.weight")
    last_stage_copy = policy.resolve("module.module.output_layer.weight")
    assert first_stage.mult == last_stage_copy.mult == 0.3
    assert f"tied copy of {EMBEDDING_WEIGHT}" in last_stage_copy.source
    assert 0.5 not in policy.multipliers()  # the output flag has no effect when tied
    # MTP stage: its embedding copy has the embedding's own name.
    assert _policy(emb=0.0, tied=True).resolve("embedding.word_embeddings.weight").mult == 0.0


def test_tied_warnings_name_the_flag_that_applies() -> None:
    disagree = _policy(emb=0.0, out=0.5, tied=True).warnings()
    assert len(disagree) == 1 and "--output-layer-weight-decay-mult 0.5 is ignored" in disagree[0]
    assert "--embedding-weight-decay-mult (0)" in disagree[0]
    assert _policy(out=0.5, tied=True).warnings()  # embedding unset means 1.0
    assert _policy(emb=0.5, out=0.5, tied=True).warnings() == []
    assert _policy(emb=0.0, out=0.5, tied=False).warnings() == []
    glob = _policy(overrides=["output_layer.*=0"], tied=True).warnings()
    assert len(glob) == 1 and "does not apply" in glob[0]


def test_resume_comparison_normalises_equivalent_settings() -> None:
    check_resume(_policy(), _policy(emb=1.0), "ckpt")
    check_resume(_policy(emb=0.0, out=0.5, tied=True), _policy(emb=0.0, tied=True), "ckpt")
    check_resume(_policy(overrides=["a*=0"]), _policy(overrides=[" a* = 0 "]), "ckpt")


@pytest.mark.parametrize(
    "saved, current",
    [
        (_policy(emb=0.0), _policy()),  # flag dropped on resume
        (_policy(), _policy(emb=0.0)),  # flag added on resume
        (_policy(out=0.5), _policy(out=0.25)),
        (_policy(overrides=["a*=0", "ab*=1"]), _policy(overrides=["ab*=1", "a*=0"])),  # order
    ],
)
def test_resume_with_other_multipliers_is_refused(saved, current) -> None:
    with pytest.raises(WeightDecayResumeError, match="the checkpoint /c was trained with"):
        check_resume(saved, current, "/c")


def test_glob_usage_errors_on_typos_and_warns_on_no_effect() -> None:
    policy = _policy(overrides=["*.weight=0.5", "*layernorm*=0", "*.wieght=0"])
    usage = GlobUsage.empty(policy)
    usage.count(policy, "module.decoder.layers.0.mlp.linear_fc1.weight", decided_by_flags=True)
    usage.count(policy, "module.decoder.layers.0.input_layernorm.weight", decided_by_flags=False)
    other_stage = GlobUsage.empty(policy)
    other_stage.count(policy, "output_layer.weight", decided_by_flags=True)
    usage.add(other_stage)
    assert usage.matched == [3, 1, 0] and usage.decided == [2, 0, 0]
    errors, warnings = usage.problems(policy)
    assert len(errors) == 1 and "'*.wieght=0' matches no parameter" in errors[0]
    assert len(warnings) == 1 and "'*layernorm*=0' decides no parameter" in warnings[0]


# --- the Megatron overrides -------------------------------------------------------------------


def _wd_mults(config_overrides: dict, params: dict[str, torch.nn.Parameter]) -> dict[str, float]:
    """What Megatron's _get_param_groups would give each parameter."""
    from megatron.core.optimizer_param_scheduler import combine_param_group_overrides

    return {
        name: combine_param_group_overrides(
            [v for k, v in config_overrides.items() if k.matches(p, name)]
        ).get("wd_mult", 1.0)
        for name, p in params.items()
    }


def test_overrides_extend_megatron_defaults_without_conflicts() -> None:
    from megatron.core.optimizer import OptimizerConfig, get_standard_config_overrides

    from megatron_ext.weight_decay.adapter import extend_overrides

    standard = get_standard_config_overrides(OptimizerConfig(lr=1e-3))
    policy = _policy(
        emb=0.0, out=0.25, overrides=["*.bias=0.5", "*.linear_qkv.weight=0.5", "*norm*=3"]
    )
    extended = extend_overrides(standard, policy)
    assert set(standard) <= set(extended) and len(extended) == len(standard) + 4  # 0, .25, .5, 3
    params = {
        name: torch.nn.Parameter(torch.zeros(shape))
        for name, shape in {
            "module.module.embedding.word_embeddings.weight": (8, 4),
            "module.module.decoder.layers.0.self_attention.linear_qkv.weight": (12, 4),
            "module.module.decoder.layers.0.self_attention.linear_qkv.bias": (12,),
            "module.module.decoder.layers.0.input_layernorm.weight": (4,),
            "module.module.decoder.layers.0.mlp.linear_fc2.weight": (4, 16),
            "module.module.output_layer.weight": (8, 4),
        }.items()
    }
    assert _wd_mults(extended, params) == {
        "module.module.embedding.word_embeddings.weight": 0.0,
        "module.module.decoder.layers.0.self_attention.linear_qkv.weight": 0.5,
        "module.module.decoder.layers.0.self_attention.linear_qkv.bias": 0.0,  # Megatron's
        "module.module.decoder.layers.0.input_layernorm.weight": 0.0,  # Megatron's
        "module.module.decoder.layers.0.mlp.linear_fc2.weight": 1.0,
        "module.module.output_layer.weight": 0.25,
    }


def test_no_flag_installs_nothing() -> None:
    """With no weight-decay flag, Megatron's functions stay untouched."""
    from types import SimpleNamespace

    from megatron_ext.loop.install import install
    from megatron_ext.registry.table import patch
    from megatron_ext.weight_decay.adapter import WeightDecayFeature

    feature = WeightDecayFeature()
    args = SimpleNamespace(
        embedding_weight_decay_mult=None,
        output_layer_weight_decay_mult=None,
        weight_decay_override=None,
        untie_embeddings_and_output_weights=True,
        load=None,
        no_load_optim=False,
        finetune=False,
    )
    install(args, [feature])  # validate, install, then the patches the feature needs
    assert not patch("weight-decay-overrides").is_applied()
    assert not patch("weight-decay-map").is_applied()


def test_flags_are_validated_by_the_parser(capsys) -> None:
    import argparse

    from megatron_ext.weight_decay.adapter import WeightDecayFeature

    parser = argparse.ArgumentParser()
    WeightDecayFeature().add_args(parser.add_argument_group("megatron-ext"))
    args = parser.parse_args(
        [
            "--weight-decay-override",
            "a*=0",
            "--weight-decay-override",
            "b*=2",
            "--embedding-weight-decay-mult",
            "0",
        ]
    )
    assert args.weight_decay_override == ["a*=0", "b*=2"]  # strings: args go into checkpoints
    assert args.embedding_weight_decay_mult == 0.0
    for bad in (["--weight-decay-override", "a*"], ["--output-layer-weight-decay-mult", "-1"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    assert "expected GLOB=MULT" in capsys.readouterr().err
