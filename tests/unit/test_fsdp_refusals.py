"""Megatron-FSDP (``--use-megatron-fsdp``): what megatron-ext refuses with it, on Megatron's own
parsed arguments, before anything starts (the CPU runner's refusal and torch FSDP2's checks are
in tests/e2e/test_layouts.py, through the entry point)."""

from __future__ import annotations

import sys

import pytest

from megatron_ext.common.features import FeatureError
from megatron_ext.loop import gpt_step
from megatron_ext.loop import install as loop


def _megatron_args(monkeypatch: pytest.MonkeyPatch, *flags: str):
    """Megatron's parser with the megatron-ext group, on ``flags`` (parse only, no checks)."""
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt_ext.py", *flags])
    return parse_args(loop.add_megatron_ext_args)


def test_megatron_fsdp_refuses_the_features_it_was_not_checked_with(monkeypatch) -> None:
    args = _megatron_args(
        monkeypatch,
        "--use-megatron-fsdp",
        "--signals-dir",
        "/tmp/signals",
        "--z-loss-coeff",
        "1e-4",
        "--sample-log-dir",
        "/tmp/samples",
        "--force-run-lock",
    )
    with pytest.raises(FeatureError) as refused:
        loop.refuse_under_megatron_fsdp(args)
    message = str(refused.value)
    for flag in ("--signals-dir", "--z-loss-coeff", "--sample-log-dir"):
        assert flag in message
    assert "--force-run-lock" not in message  # the run lock does not read the step
    assert "ChainedOptimizer" in message and "--use-torch-fsdp2" in message


def test_plain_megatron_fsdp_and_the_other_wrappers_start(monkeypatch) -> None:
    loop.refuse_under_megatron_fsdp(_megatron_args(monkeypatch, "--use-megatron-fsdp"))
    with_features = ["--signals-dir", "/tmp/signals", "--log-bucket-grad-norms"]
    loop.refuse_under_megatron_fsdp(
        _megatron_args(monkeypatch, "--use-torch-fsdp2", *with_features)
    )
    loop.refuse_under_megatron_fsdp(_megatron_args(monkeypatch, *with_features))


def test_megatron_fsdp_without_einops_is_refused_before_its_assertion(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "einops", None)  # Python's own "not importable" mark
    with pytest.raises(SystemExit, match="--use-megatron-fsdp needs einops"):
        gpt_step._check_megatron_fsdp()
