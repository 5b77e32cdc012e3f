"""Weight-decay multipliers: the policy (precedence, tied/PP/MTP names, validation, resume
comparison), the Megatron overrides it produces, and the real update in the CPU harness.

The end-to-end proof uses two DP=2 distributed-optimizer runs that differ only in
``--weight-decay`` (0 vs ``WD``), both with ``--embedding-weight-decay-mult 0``: the first
Adam step is identical in both, so any difference between their iteration-1 checkpoints is
the decoupled decay term ``lr * WD * wd_mult * param_0`` and nothing else.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness import Run, launch
from megatron_ext.weight_decay import (
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

pytestmark = pytest.mark.timeout(900)


def _policy(emb=None, out=None, overrides=(), tied=False) -> WeightDecayPolicy:
    return policy_from_values(emb, out, list(overrides), tied)


# --- the policy -------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("*.linear_proj.weight=0.5", Override("*.linear_proj.weight", 0.5)),
    (" decoder.* = 0 ", Override("decoder.*", 0.0)),
    ("odd=name=2", Override("odd=name", 2.0)),
])
def test_parse_override(text: str, expected: Override) -> None:
    assert parse_override(text) == expected


@pytest.mark.parametrize("text, message", [
    ("decoder.*", "expected GLOB=MULT"),
    ("=0.5", "expected GLOB=MULT"),
    ("decoder.*=", "expected GLOB=MULT"),
    ("decoder.*=half", "'half' is not a number"),
    ("decoder.*=-1", "finite and >= 0"),
    ("decoder.*=nan", "finite and >= 0"),
])
def test_parse_override_rejects_with_a_clear_message(text: str, message: str) -> None:
    with pytest.raises(WeightDecayConfigError, match=message):
        parse_override(text)


def test_role_flags_validated() -> None:
    with pytest.raises(WeightDecayConfigError, match="--embedding-weight-decay-mult.*>= 0"):
        _policy(emb=-0.1)
    with pytest.raises(WeightDecayConfigError, match="--output-layer-weight-decay-mult"):
        _policy(out=float("inf"))


def test_no_flag_is_inactive_and_decides_nothing() -> None:
    policy = _policy()
    assert not policy.active
    assert policy.multipliers() == set()
    assert policy.resolve("module.module.embedding.word_embeddings.weight").mult == 1.0


def test_precedence_last_glob_then_role_then_default() -> None:
    policy = _policy(emb=0.0, out=0.25, overrides=["decoder.*=0.5", "*.linear_fc1.weight=2",
                                                   "embedding.position_*=0.1"])
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


@pytest.mark.parametrize("saved, current", [
    (_policy(emb=0.0), _policy()),  # flag dropped on resume
    (_policy(), _policy(emb=0.0)),  # flag added on resume
    (_policy(out=0.5), _policy(out=0.25)),
    (_policy(overrides=["a*=0", "ab*=1"]), _policy(overrides=["ab*=1", "a*=0"])),  # order
])
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
            [v for k, v in config_overrides.items() if k.matches(p, name)]).get("wd_mult", 1.0)
        for name, p in params.items()
    }


def test_overrides_extend_megatron_defaults_without_conflicts() -> None:
    from megatron.core.optimizer import OptimizerConfig, get_standard_config_overrides

    from megatron_ext.weight_decay_adapter import extend_overrides

    standard = get_standard_config_overrides(OptimizerConfig(lr=1e-3))
    policy = _policy(emb=0.0, out=0.25, overrides=["*.bias=0.5", "*.linear_qkv.weight=0.5",
                                                   "*norm*=3"])
    extended = extend_overrides(standard, policy)
    assert set(standard) <= set(extended) and len(extended) == len(standard) + 4  # 0, .25, .5, 3
    params = {name: torch.nn.Parameter(torch.zeros(shape)) for name, shape in {
        "module.module.embedding.word_embeddings.weight": (8, 4),
        "module.module.decoder.layers.0.self_attention.linear_qkv.weight": (12, 4),
        "module.module.decoder.layers.0.self_attention.linear_qkv.bias": (12,),
        "module.module.decoder.layers.0.input_layernorm.weight": (4,),
        "module.module.decoder.layers.0.mlp.linear_fc2.weight": (4, 16),
        "module.module.output_layer.weight": (8, 4),
    }.items()}
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

    from megatron_ext import patches
    from megatron_ext.weight_decay_adapter import OVERRIDES, PARAM_MAP, install

    install(SimpleNamespace(embedding_weight_decay_mult=None, output_layer_weight_decay_mult=None,
                            weight_decay_override=None, untie_embeddings_and_output_weights=True,
                            load=None, no_load_optim=False, finetune=False))
    assert not patches.is_applied(OVERRIDES) and not patches.is_applied(PARAM_MAP)


# --- the real update, DP=2 with the distributed optimizer --------------------------------------

LR, WD = 1e-3, 1.0
DECAY_FLAGS = [
    "--embedding-weight-decay-mult", "0", "--output-layer-weight-decay-mult", "0.25",
    "--weight-decay-override", "*.linear_fc2.weight=0.5",
    "--weight-decay-override", "*layernorm*=0.5",  # 1-D only: Megatron's exemption wins
]
EXPECTED_MULT = {
    "embedding.word_embeddings.weight": 0.0,
    "output_layer.weight": 0.25,
    "decoder.layers.mlp.linear_fc2.weight": 0.5,
    "decoder.layers.mlp.linear_fc1.weight": 1.0,
    "decoder.layers.self_attention.linear_qkv.weight": 1.0,
    "decoder.layers.self_attention.linear_proj.weight": 1.0,
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight": 0.0,
    "decoder.layers.mlp.linear_fc1.layer_norm_weight": 0.0,
    "decoder.final_layernorm.weight": 0.0,
}


def _one_step(work: Path, data_args: list[str], weight_decay: float) -> Run:
    args = [*data_args, *DECAY_FLAGS, "--use-distributed-optimizer", "--train-iters", "1",
            "--lr", str(LR), "--lr-decay-style", "constant", "--lr-warmup-iters", "0",
            "--clip-grad", "0", "--weight-decay", str(weight_decay),
            "--save", str(work / "ckpt"), "--save-interval", "1"]
    run = launch(work, args, nproc=2)
    assert run.returncode == 0, run.log[-4000:]
    return run


@pytest.fixture(scope="module")
def decay_runs(tmp_path_factory, data_args) -> dict[float, Run]:
    """Same seed, data and first Adam step; only --weight-decay differs (0 vs WD)."""
    root = tmp_path_factory.mktemp("weight-decay")
    return {wd: _one_step(root / f"wd{wd:g}", data_args, wd) for wd in (0.0, WD)}


def _model_tensors(run: Run) -> dict[str, torch.Tensor]:
    """The model's full tensors from the torch_dist checkpoint of iteration 1 (no process
    group needed: torch.distributed.checkpoint reassembles the shards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = str(run.workdir / "ckpt" / "iter_0000001")
    metadata = dcp.FileSystemReader(path).read_metadata()
    tensors = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
               for key, meta in metadata.state_dict_metadata.items()
               if isinstance(meta, TensorStorageMetadata) and not key.startswith("optimizer.")}
    dcp.load(tensors, checkpoint_id=path, no_dist=True)
    return tensors


def test_embedding_update_has_no_decay_term_other_weights_decay_exactly(
    decay_runs: dict[float, Run],
) -> None:
    """AdamW step 1: p1 = p0 * (1 - lr*wd*mult) - lr * g/(|g| + eps). The Adam part is the
    same in both runs, so p1(wd=0) - p1(wd=WD) = lr*WD*mult*p0, with p0 = p1(wd=0) + u,
    |u| <= lr and |u| == lr wherever |g| >> eps (most elements)."""
    plain, decayed = _model_tensors(decay_runs[0.0]), _model_tensors(decay_runs[WD])
    assert set(EXPECTED_MULT) == set(plain), "unexpected model parameters in the checkpoint"
    for name, mult in EXPECTED_MULT.items():
        if mult == 0.0:
            assert torch.equal(plain[name], decayed[name]), f"{name} was decayed"
            continue
        p0_estimate = (plain[name] - decayed[name]) / (LR * WD * mult)
        adam_step = (p0_estimate - plain[name]).abs()
        rounding = 4 * torch.finfo(torch.float32).eps * plain[name].abs().max() / (LR * WD * mult)
        assert adam_step.max() <= LR + rounding, f"{name}: decay is not lr*wd*{mult}*p0"
        assert adam_step.median() == pytest.approx(LR, rel=1e-2), name


def test_start_up_map_lists_each_parameter_and_its_rule(decay_runs: dict[float, Run]) -> None:
    log = decay_runs[WD].log
    assert log.count("megatron-ext weight decay per parameter = --weight-decay 1 x wd_mult") == 1
    for line in (
        "pp0 embedding.word_embeddings.weight wd_mult=0 <- --embedding-weight-decay-mult",
        "pp0 output_layer.weight wd_mult=0.25 <- --output-layer-weight-decay-mult",
        "pp0 decoder.layers.1.mlp.linear_fc2.weight wd_mult=0.5 <- --weight-decay-override "
        "*.linear_fc2.weight=0.5",
        "pp0 decoder.layers.0.mlp.linear_fc1.weight wd_mult=1 <- default",
        "pp0 decoder.final_layernorm.weight wd_mult=0 <- Megatron: no decay for 1-D params",
        "WARNING: --weight-decay-override '*layernorm*=0.5' decides no parameter",
    ):
        assert line in log, line


def test_resume_with_other_multipliers_is_refused_before_training(
    decay_runs: dict[float, Run], data_args: list[str], tmp_path: Path,
) -> None:
    """Dropping the flags on resume would silently regroup the optimizer: refused at start-up."""
    checkpoint = decay_runs[WD].workdir / "ckpt"
    run = launch(tmp_path, [*data_args, "--use-distributed-optimizer", "--load", str(checkpoint),
                            "--train-iters", "2"], nproc=2)
    assert run.returncode != 0
    assert "WeightDecayResumeError" in run.log
    assert (f"the checkpoint {checkpoint}/iter_0000001 was trained with "
            "--embedding-weight-decay-mult 0 --output-layer-weight-decay-mult 0.25 "
            "--weight-decay-override '*.linear_fc2.weight=0.5'") in run.log
    assert "this run sets no weight-decay multiplier flags" in run.log
    assert "iteration        2/" not in run.log


def test_resume_check_reads_the_real_checkpoint(decay_runs: dict[float, Run]) -> None:
    """The same check in-process on the saved args: equal flags pass, a changed one fails."""
    from harness import checkpoint_args
    from megatron_ext.weight_decay_adapter import check_resume_compatible, policy_from_args

    checkpoint = decay_runs[WD].workdir / "ckpt"
    args = checkpoint_args(checkpoint, 1)
    args.load = str(checkpoint)
    check_resume_compatible(args, policy_from_args(args))
    args.weight_decay_override = ["*.linear_fc2.weight=0.4"]
    with pytest.raises(WeightDecayResumeError, match="--weight-decay-override '\\*.linear_fc2"):
        check_resume_compatible(args, policy_from_args(args))
    args.no_load_optim = True  # a fresh optimizer state has nothing to mismatch
    check_resume_compatible(args, policy_from_args(args))


def test_flags_are_validated_by_the_parser(capsys) -> None:
    import argparse

    from megatron_ext.weight_decay_adapter import add_args

    parser = argparse.ArgumentParser()
    add_args(parser.add_argument_group("megatron-ext"))
    args = parser.parse_args(["--weight-decay-override", "a*=0", "--weight-decay-override",
                              "b*=2", "--embedding-weight-decay-mult", "0"])
    assert args.weight_decay_override == ["a*=0", "b*=2"]  # strings: args go into checkpoints
    assert args.embedding_weight_decay_mult == 0.0
    for bad in (["--weight-decay-override", "a*"], ["--output-layer-weight-decay-mult", "-1"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    assert "expected GLOB=MULT" in capsys.readouterr().err
