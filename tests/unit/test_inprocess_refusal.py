"""Megatron's ``--inprocess-restart`` with megatron-ext's features is refused at start-up with
what to run instead; on its own (the launchers' watchdog enabled by the environment, no flag)
it starts. On Megatron's own parsed arguments."""

from __future__ import annotations

import pytest

from megatron_ext.common.features import FeatureError
from megatron_ext.loop import install as loop
from tests.unit.test_fsdp_refusals import _megatron_args


def test_inprocess_restart_with_the_spike_detector_is_refused(monkeypatch) -> None:
    args = _megatron_args(
        monkeypatch, "--inprocess-restart", "--spike-detect", "--signals-dir", "/tmp/s"
    )
    with pytest.raises(FeatureError) as refused:
        loop.refuse_inprocess_restart(args)
    message = str(refused.value)
    assert "--spike-detect" in message and "--signals-dir" in message
    assert "replays the spike instead of rolling back" in message
    assert "ft_launcher" in message and "launch/run_single_node.sh" in message


def test_inprocess_restart_alone_and_the_features_alone_start(monkeypatch) -> None:
    loop.refuse_inprocess_restart(_megatron_args(monkeypatch, "--inprocess-restart"))
    loop.refuse_inprocess_restart(_megatron_args(monkeypatch, "--spike-detect"))
