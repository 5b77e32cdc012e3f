"""The z-loss feature: refused combinations, Megatron's fused CE accepted (TE's routed, said
once), no patch at c=0, and the loss function's terms picked by the identity of the tensor
Megatron's loss method returned."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_ext.common.features import FeatureError, FeatureSet, LossInputs, MicroBatch
from megatron_ext.loop.gpt_step import loss_func
from megatron_ext.registry.table import patch
from megatron_ext.zloss import cross_entropy_and_z_loss
from megatron_ext.zloss.adapter import ZLossFeature, with_z_loss

SEQ, BATCH, VOCAB = 8, 3, 96
ZLOSS = patch("zloss-output-layer")
# A language module as the loss method reads it: no TP group, Megatron's cross entropy unfused.
UNFUSED = SimpleNamespace(
    tp_group=None,
    config=SimpleNamespace(cross_entropy_loss_fusion=False, cross_entropy_fusion_impl="native"),
)


def _args(**overrides: object) -> SimpleNamespace:
    return SimpleNamespace(
        **{
            "z_loss_coeff": 1e-4,
            "cross_entropy_loss_fusion": False,
            "fused_output_loss": False,
            "fused_output_loss_chunk_tokens": 0,
            "log_output_z": False,
            **overrides,
        }
    )


def _problem() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(SEQ, BATCH, VOCAB, generator=gen) * 3 + 20
    target = torch.randint(0, VOCAB, (SEQ, BATCH), generator=gen)
    mask = (torch.rand(SEQ, BATCH, generator=gen) > 0.33).float()
    return logits, target, mask


def _inputs(per_token: torch.Tensor, mask: torch.Tensor) -> LossInputs:
    flat = mask.T.reshape(-1)
    return LossInputs(
        MicroBatch(1, True, 0),
        per_token,
        flat,
        (per_token.reshape(-1) * flat).sum(),
        flat.sum().to(torch.int),
    )


def test_cross_entropy_fusion_is_accepted_and_te_is_routed_with_one_line(capsys) -> None:
    """Native composes (test_zloss_megatron_fused.py); TE's fused CE gives no log Z, so the
    overlay's kernel runs instead, said once at start-up."""
    for impl in ("native", "te"):
        args = _args(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl=impl)
        feature = ZLossFeature()
        feature.validate(args)
        feature.install(args)
    said = capsys.readouterr().out
    assert said.count("\n") == 1 and "--cross-entropy-fusion-impl te" in said
    assert "overlay's one-pass vocab-parallel CE + z kernel instead" in said
    logits, target, _ = _problem()
    te_module = SimpleNamespace(
        tp_group=None,
        config=SimpleNamespace(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te"),
    )
    loss = with_z_loss(None, feature)(te_module, target.T.contiguous(), logits.clone())
    assert torch.equal(loss, cross_entropy_and_z_loss(logits, target, 1e-4).loss.T)
    assert not ZLOSS.is_applied()


@pytest.mark.parametrize("coeff", [-1e-4, float("nan"), float("inf")])
def test_invalid_coefficient_is_refused(coeff: float) -> None:
    with pytest.raises(FeatureError, match="--z-loss-coeff must be a finite number >= 0"):
        ZLossFeature().validate(_args(z_loss_coeff=coeff))


def test_coefficient_0_is_not_enabled_so_nothing_is_patched() -> None:
    assert not ZLossFeature().enabled(_args(z_loss_coeff=0.0, cross_entropy_loss_fusion=True))
    assert not ZLOSS.is_applied()


def test_loss_function_reports_the_main_heads_pure_ce_and_z() -> None:
    """MTP heads call the same method first; the loss function gets the main head's tensor."""
    feature = ZLossFeature()
    feature.coeff = 1e-4
    ZLOSS.verify()
    compute_loss = with_z_loss(None, feature)  # type: ignore[arg-type]
    logits, target, mask = _problem()
    labels = target.transpose(0, 1).contiguous()  # GPTModel passes [b, s] labels
    mtp_head = compute_loss(UNFUSED, labels, (logits * 0.5).clone())
    main = compute_loss(UNFUSED, labels, logits.clone())
    expected = cross_entropy_and_z_loss(logits, target, 1e-4)
    assert main.shape == (BATCH, SEQ) and torch.equal(main, expected.loss.T)
    report = feature.on_loss(_inputs(main, mask))
    flat = mask.T.reshape(-1)
    assert list(report) == ["lm loss", "z loss"]
    assert torch.equal(
        report["lm loss"],
        torch.stack([torch.sum(expected.cross_entropy.T.reshape(-1) * flat), flat.sum()]),
    )
    assert torch.equal(report["z loss"][0], torch.sum(expected.z_loss.T.reshape(-1) * flat))
    assert feature.pending == []  # consumed, the MTP head's terms too
    # A tensor the patched method did not return means Megatron's loss path changed.
    compute_loss(UNFUSED, labels, logits.clone())
    with pytest.raises(RuntimeError, match="compute_language_model_loss did not return"):
        feature.on_loss(_inputs(mtp_head, mask))


def test_evaluation_reports_no_perplexity_of_the_z_loss_nor_of_log_z() -> None:
    """Megatron prints exp(value) as "PPL" for every evaluation entry: "z loss PPL: 4.85E+08"
    meant nothing. Training keeps both entries; evaluation keeps the cross entropy only."""
    feature = ZLossFeature()
    feature.coeff, feature.log_z = 1e-4, True
    ZLOSS.verify()
    compute_loss = with_z_loss(None, feature)  # type: ignore[arg-type]
    logits, target, mask = _problem()
    labels = target.transpose(0, 1).contiguous()
    features = FeatureSet(
        SimpleNamespace(check_for_nan_in_loss_and_grad=False, check_for_spiky_loss=False),
        (feature,),
    )
    for training, expected in ((True, ["lm loss", "z loss", "log z"]), (False, ["lm loss"])):
        per_token = compute_loss(UNFUSED, labels, logits.clone())
        micro_batch = MicroBatch(1, training, 0)
        _, _, report = loss_func(features, mask.T.reshape(-1), micro_batch, per_token)
        assert list(report) == expected
