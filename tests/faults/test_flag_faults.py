"""Flag values that switched the safety net off while the job reported success: exit codes
outside 8 bits or already taken, NaN thresholds, a telemetry path naming a file. Each is
refused before distributed initialisation, by the features' ``validate`` hooks and by the
supervisor, which also never reads a rollback as success."""

from __future__ import annotations

import argparse

import pytest
from megatron.training.arguments import add_megatron_arguments

from megatron_ext.common.features import FeatureError, FeatureSet
from megatron_ext.loop import install as loop
from megatron_ext.supervise import commands, policy
from megatron_ext.supervise.knobs import KnobError
from tests.support.faults import fault
from tests.support.harness import launch


def _args(tmp_path, *flags: str) -> argparse.Namespace:
    """Megatron's own parser with the overlay's group, as the entry point parses the flags
    (rank and world size are set by Megatron's validation, which needs a launch)."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    loop.add_megatron_ext_args(parser)
    args = parser.parse_args(["--save", str(tmp_path / "ckpt"), *flags])
    args.rank, args.world_size = 0, 1
    return args


def _validate(tmp_path, *flags: str) -> None:
    """Every enabled feature's ``validate``: what ``loop.install`` runs before init."""
    args = _args(tmp_path, *flags)
    for feature in loop.all_features():
        if feature.enabled(args):
            feature.validate(args)


@pytest.mark.e2e
@fault(
    "`--spike-exit-code 256` (the kernel keeps 8 bits: 256 exits as 0) and `0`, `16`, `17`, "
    "`43` (the hang watchdog's), `137`; `--spike-loss-rel nan`, `--spike-large-rel inf`; "
    "window or patience 0; "
    "`--sample-log-dir`/`--signals-dir` naming a file",
    "refused before distributed initialisation, naming the flag, the value and what is "
    "allowed (exit codes 3-125 other than 16/17/43); the supervisor refuses the same exit codes "
    "and never reads an exit 0 with a new ledger rollback request as success",
    area="training start-up",
)
def test_bad_exit_codes_nan_thresholds_and_wrong_paths_are_refused(data_args, tmp_path) -> None:
    signals = ["--spike-detect", "--signals-dir", str(tmp_path / "signals")]
    run = launch(tmp_path / "run", [*data_args, *signals, "--spike-exit-code", "256"])
    assert run.returncode != 0
    assert "--spike-exit-code 256: exit statuses are 8 bits, so 256 would end the process as 0" in (
        run.log
    )
    assert "initializing torch distributed" not in run.log  # refused before init
    assert "spikes/adapter.py" not in run.log  # a message, not a traceback of ours

    file = tmp_path / "a-file"
    file.write_text("x")
    refused = {
        ("--spike-exit-code", "0"): "0 already means success",
        ("--spike-exit-code", "16"): "EXIT_CODE_RESUME_TO_DISAMBIGUATE",
        ("--spike-exit-code", "17"): "EXIT_CODE_FAILED_ON_RESULT_VALIDATION",
        ("--spike-exit-code", "43"): "hang watchdog",
        ("--spike-exit-code", "137"): "killed by signal 9",
        ("--spike-exit-code", "-1"): "exit statuses are 8 bits",
        ("--spike-loss-rel", "nan"): "--spike-loss-rel must be a finite number, got nan",
        ("--spike-large-rel", "inf"): "--spike-large-rel must be a finite number, got inf",
        ("--spike-patience", "0"): "patience >= 1",
        ("--spike-window", "0"): "window >= 3",
    }
    for (flag, value), message in refused.items():
        with pytest.raises(FeatureError, match=message.replace("(", r"\(")):
            _validate(tmp_path, *signals, flag, value)
    with pytest.raises(FeatureError, match="exists and is not a directory"):
        _validate(tmp_path, "--sample-log-dir", str(file))
    with pytest.raises(FeatureError, match="is a file, so"):
        _validate(tmp_path, "--signals-dir", str(file / "signals"))
    _validate(tmp_path, *signals, "--spike-exit-code", "44")  # a free code is accepted

    for code in ("256", "0", "17"):
        with pytest.raises(KnobError, match="--spike-exit-code"):
            commands.training_facts(["--spike-exit-code", code])
    budget = policy.Budget(0, 10, 0, 5, requeue=False)
    success_with_request = policy.Outcome(0, (0,), 42, ledger_confirms=True)
    decision = policy.decide(success_with_request, budget)
    assert decision.action == "stop" and decision.exit_code != 0
    assert "a rollback is never a success" in decision.reason
    assert policy.decide(policy.Outcome(0, (0,), 42, False), budget).action == "finish"


def test_feature_set_validates_before_installing(tmp_path) -> None:
    """A refused flag leaves nothing half-installed (validate runs for every feature first):
    no run lock taken, no skip list written."""
    args = _args(tmp_path, "--iterations-to-skip", "3", "--z-loss-coeff", "nan")
    with pytest.raises(FeatureError, match="--z-loss-coeff must be a finite number"):
        FeatureSet.install(loop.all_features(), args)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--signals-attention-logit", "--transformer-impl", "local"], "needs --signals-dir"),
        (["--fused-output-loss-chunk-tokens", "48"], "needs --fused-output-loss"),
        (["--drill-corrupt-batch", "5:2"], "DP rank 2 does not exist"),
        (["--drill-corrupt-batch", "30-40:1", "--train-iters", "20"], "never reaches 30"),
        (["--drill-corrupt-source", "code"], "needs --drill-corrupt-batch"),
        (["--drill-corruption", "mis-encoded"], "needs --drill-corrupt-batch"),
    ],
)
def test_flags_that_would_silently_do_nothing_are_refused(tmp_path, flags, message) -> None:
    """A value argparse accepts whose feature would never act (a drill on a DP rank the run does
    not have, a signals field without the signals log): refused, not silently ignored."""
    args = _args(tmp_path, *flags)
    args.data_parallel_size = 2  # set by Megatron's validation
    with pytest.raises(FeatureError, match=message):
        FeatureSet.install(loop.all_features(), args)
    assert not (tmp_path / "ckpt").exists()  # refused before the run lock
    args = _args(tmp_path, "--drill-corrupt-batch", "5:1", "--train-iters", "20")
    args.data_parallel_size = 2
    for feature in loop.all_features():  # the drill on a rank and iteration the run has
        if feature.enabled(args):
            feature.validate(args)
