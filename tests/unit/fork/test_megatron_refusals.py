"""Megatron's own check of the flags (``validate_args``) asserts; the entry point turns those
assertions, and only those, into one-line refusals. In process, with megatron-core's real
parser and check, at a world size of 2."""

from __future__ import annotations

import sys

import pytest
from megatron.training.arguments import parse_args, validate_args

from megatron_ext.fork.start import megatron_refusal
from tests.support.harness import CPU_FLAGS, TINY_MODEL, TINY_TRAINING

FSDP2 = ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"]
CASES = {
    "pipeline": ([*FSDP2, "--pipeline-model-parallel-size", "2"], "with pipeline parallelism"),
    "tied": (["--use-torch-fsdp2"], "requires --untie-embeddings-and-output-weights"),
    "fp16": ([*FSDP2, "--fp16"], "not supported with fp16"),
    "distopt": ([*FSDP2, "--use-distributed-optimizer"], "distributed optimizer"),
}


def _validated(monkeypatch: pytest.MonkeyPatch, flags: list[str]) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    untied = "--untie-embeddings-and-output-weights"
    model = [f for f in TINY_MODEL if f != untied]  # the cases say whether it is untied
    monkeypatch.setattr(sys, "argv", ["pretrain", *model, *CPU_FLAGS, *TINY_TRAINING, *flags])
    validate_args(parse_args())


@pytest.mark.parametrize("case", CASES)
def test_fsdp2_layouts_megatron_asserts_on_become_one_line(
    monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    flags, says = CASES[case]
    with pytest.raises(AssertionError) as raised:
        _validated(monkeypatch, flags)
    refusal = megatron_refusal(raised.value)
    assert refusal is not None and "\n" not in refusal
    assert refusal.startswith("megatron-ext: Megatron refuses these flags: --use-torch-fsdp2")
    assert says in refusal and "change the flags it names" in refusal


def test_other_assertions_keep_their_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    _validated(monkeypatch, FSDP2)  # a layout Megatron accepts
    with pytest.raises(AssertionError) as raised:
        assert 1 + 1 == 3, "a bug elsewhere"
    assert megatron_refusal(raised.value) is None
