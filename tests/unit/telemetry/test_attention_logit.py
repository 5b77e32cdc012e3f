"""``--signals-attention-logit`` on megatron-core's own local attention: the max over unmasked
scores as the softmax will see them (scale applied, future masked), training forwards only,
one hook per attention of a real GPTModel; and its refusals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import attention_mask_func

from megatron_ext.common.features import FeatureError
from megatron_ext.telemetry.attention_logit import AttentionLogitFeature
from tests.support import megatron_world as mw


def _softmax(scale: float | None) -> FusedScaleMaskSoftmax:
    return FusedScaleMaskSoftmax(
        input_in_fp16=False,
        input_in_bf16=False,
        attn_mask_type=AttnMaskType.causal,
        scaled_masked_softmax_fusion=False,
        mask_func=attention_mask_func,
        softmax_in_fp32=True,
        scale=scale,
    )


def test_the_max_is_over_what_the_softmax_attends_to() -> None:
    feature = AttentionLogitFeature()
    softmax = _softmax(scale=2.0)
    softmax.train()
    scores = torch.randn(2, 3, 5, 5)
    scores[0, 1, 2, 4] = 1000.0  # the future of query 2: masked, never attended
    scores[1, 2, 3, 1] = 7.0  # the largest attended score
    # No mask: the causal softmax masks the future itself (Megatron's default mask is made
    # on the GPU, so the hook is called as the module would call it).
    feature._scores(softmax, (scores, None, None))
    assert feature.step_max is not None
    assert feature.step_max.item() == pytest.approx(2.0 * 7.0)
    # An explicit mask (True: masked), here the causal one plus that score: the softmax runs.
    explicit = torch.ones(5, 5, dtype=torch.bool).triu(1)[None, None].clone()
    explicit[..., 3, 1] = True
    feature.step_max = None
    softmax.register_forward_pre_hook(feature._scores)
    softmax(scores, explicit)
    expected = scores.masked_fill(explicit, -torch.inf).amax() * 2.0
    assert feature.step_max.item() == pytest.approx(expected.item()) and expected < 14.0


def test_evaluation_forwards_are_not_counted() -> None:
    feature = AttentionLogitFeature()
    softmax = _softmax(scale=None)
    softmax.register_forward_pre_hook(feature._scores)
    softmax.eval()
    softmax(torch.randn(1, 1, 4, 4), torch.ones(4, 4, dtype=torch.bool).triu(1)[None, None])
    assert feature.step_max is None


def test_every_attention_of_a_real_gpt_is_hooked() -> None:
    with mw.megatron_world(), mw.patches_undone():
        model = mw.tiny_gpt()
        feature = AttentionLogitFeature()
        feature.on_model_built([model])
        micro = mw.batch(seed=2)
        model.train()
        model(micro["tokens"], micro["position_ids"], None, labels=micro["labels"])
        trained = feature.step_max
        assert trained is not None and torch.isfinite(trained).all() and trained.item() > 0
        hooked = [
            m.self_attention.core_attention.scale_mask_softmax._forward_pre_hooks
            for m in model.decoder.layers
        ]
        assert all(len(h) == 1 for h in hooked) and len(hooked) == mw.LAYERS


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"transformer_impl": "transformer_engine"}, "use Megatron's --log-max-attention-logit"),
        ({"log_max_attention_logit": True}, "keep one"),
        ({"window_size": (128, 0)}, "sliding-window"),
        ({"signals_dir": None}, "needs --signals-dir"),  # recorded nowhere else
    ],
)
def test_what_it_cannot_read_is_refused(overrides: dict, message: str) -> None:
    args = SimpleNamespace(
        **{
            "signals_attention_logit": True,
            "signals_dir": "signals",
            "transformer_impl": "local",
            "log_max_attention_logit": False,
            "window_size": None,
            **overrides,
        }
    )
    with pytest.raises(FeatureError, match=message):
        AttentionLogitFeature().validate(args)
