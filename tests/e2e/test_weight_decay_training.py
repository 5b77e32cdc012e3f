"""Weight-decay multipliers in the real update (CPU harness, DP=2, distributed optimizer).

Two runs that differ only in ``--weight-decay`` (0 vs ``WD``), both with
``--embedding-weight-decay-mult 0``: the first Adam step is identical in both, so any
difference between their iteration-1 checkpoints is the decoupled decay term
``lr * WD * wd_mult * param_0`` and nothing else.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_ext.weight_decay.core import WeightDecayResumeError
from tests.support.harness import Run, launch, rank0_alone

LR, WD = 1e-3, 1.0


DECAY_FLAGS = [
    "--embedding-weight-decay-mult",
    "0",
    "--output-layer-weight-decay-mult",
    "0.25",
    "--weight-decay-override",
    "*.linear_fc2.weight=0.5",
    "--weight-decay-override",
    "*layernorm*=0.5",  # 1-D only: Megatron's exemption wins
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
    args = [
        *data_args,
        *DECAY_FLAGS,
        "--use-distributed-optimizer",
        "--train-iters",
        "1",
        "--lr",
        str(LR),
        "--lr-decay-style",
        "constant",
        "--lr-warmup-iters",
        "0",
        "--clip-grad",
        "0",
        "--weight-decay",
        str(weight_decay),
        "--save",
        str(work / "ckpt"),
        "--save-interval",
        "1",
    ]
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
    tensors = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata) and not key.startswith("optimizer.")
    }
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
    decay_runs: dict[float, Run],
    data_args: list[str],
) -> None:
    """Dropping the flags on resume would silently regroup the optimizer: refused at start-up.
    Rank 0 of the same DP=2 job alone (every rank runs the same check on the same saved args):
    the refusal must come before distributed init, which would wait for a rank 1 forever."""
    checkpoint = decay_runs[WD].workdir / "ckpt"
    result = rank0_alone(
        [
            *data_args,
            "--use-distributed-optimizer",
            "--load",
            str(checkpoint),
            "--train-iters",
            "2",
        ]
    )
    log = result.stdout + result.stderr
    assert result.returncode != 0, log[-3000:]
    # A WeightDecayResumeError, reported as its message: no traceback of ours.
    assert "weight_decay/core.py" not in log and "weight_decay/adapter.py" not in log
    assert (
        f"the checkpoint {checkpoint}/iter_0000001 was trained with "
        "--embedding-weight-decay-mult 0 --output-layer-weight-decay-mult 0.25 "
        "--weight-decay-override '*.linear_fc2.weight=0.5'"
    ) in log
    assert "this run sets no weight-decay multiplier flags" in log
    assert "iteration        2/" not in log
    assert "initializing torch distributed" not in log, "refused after start-up"


def test_resume_check_reads_the_real_checkpoint(decay_runs: dict[float, Run]) -> None:
    """The same check in-process on the saved args: equal flags pass, a changed one fails."""
    from megatron_ext.weight_decay.adapter import check_resume_compatible, policy_from_args
    from tests.support.harness import checkpoint_args

    checkpoint = decay_runs[WD].workdir / "ckpt"
    args = checkpoint_args(checkpoint, 1)
    args.load = str(checkpoint)
    check_resume_compatible(args, policy_from_args(args))
    args.weight_decay_override = ["*.linear_fc2.weight=0.4"]
    with pytest.raises(WeightDecayResumeError, match=r"--weight-decay-override '\*\.linear_fc2"):
        check_resume_compatible(args, policy_from_args(args))
    args.no_load_optim = True  # a fresh optimizer state has nothing to mismatch
    check_resume_compatible(args, policy_from_args(args))
