"""Through the real entry point: an assertion of Megatron's flag check (torch FSDP2 with
pipeline parallelism) ends the start-up with one line, exit 1, before distributed init."""

from __future__ import annotations

from tests.support.harness import rank0_alone


def test_fsdp2_with_pipeline_parallelism_is_one_line_before_distributed_init(
    data_args: list[str],
) -> None:
    result = rank0_alone([*data_args, "--use-torch-fsdp2", "--pipeline-model-parallel-size", "2"])
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    line = "megatron-ext: Megatron refuses these flags: --use-torch-fsdp2 is not supported with "
    assert f"{line}pipeline parallelism (its validate_args)" in output, output[-3000:]
    assert "Traceback" not in output and "initializing torch distributed" not in output
