"""Bad flags that used to be found late or answered wrongly: a weight-decay GLOB matching
nothing (found only after DDP and the optimizer), a negative ``--consumed-samples``."""

from __future__ import annotations

import pytest

from megatron_ext.lookup import cli
from tests.support.faults import fault
from tests.support.harness import launch


@pytest.mark.e2e
@fault(
    "`--weight-decay-override` with a GLOB that matches no parameter",
    "refused right after the model is built, before mixed-precision/DDP wrapping and the "
    "optimizer (the earliest point names exist), naming the GLOB and sample names",
    area="training start-up",
)
def test_an_unmatched_weight_decay_glob_fails_before_ddp(data_args, tmp_path) -> None:
    run = launch(
        tmp_path, [*data_args, "--weight-decay-override", "decoder.layer.*.mlp*=0.5"], timeout=300
    )
    assert run.returncode != 0
    assert "'decoder.layer.*.mlp*=0.5' matches no parameter of the model" in run.log
    assert "decoder.layers.0." in run.log  # the names it could have matched
    # Megatron prints the parameter count while wrapping, and builds DDP buckets and the
    # optimizer after that: none of it happened.
    assert "number of parameters on" not in run.log
    assert "weight_decay/adapter.py" not in run.log  # a message, not a traceback of ours


@fault(
    "`lookup --consumed-samples -8`",
    "usage error (exit 2) saying it must be >= 0, not 'beyond --train-iters'",
    area="lookup",
)
def test_negative_consumed_samples_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--consumed-samples", "-8", "--data-parallel-size", "1"])
    assert exit_.value.code == 2
    assert "--consumed-samples must be >= 0, got -8" in capsys.readouterr().err
