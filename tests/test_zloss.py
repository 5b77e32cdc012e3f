"""Output z-loss: values and gradients against a float64 full-vocabulary reference (TP=1 and
TP=2 over gloo), bit-equality with Megatron's cross entropy at c=0, input logits untouched,
bf16 inputs, refused combinations, the patch's logging side channel, and the real training
loop (TP=2) with and without ``--z-loss-coeff``."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness import Run, launch
from megatron_ext import patch_report, patches, zloss_adapter
from megatron_ext.signals import SIGNALS_FILE, read_signals
from megatron_ext.zloss import cross_entropy_and_z_loss, vocab_parallel_cross_entropy_with_z_loss

COEFFS = (0.0, 1e-4, 1e-2)
SEQ, BATCH, VOCAB = 8, 3, 96
RTOL = 1e-5


def _problem(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full-vocabulary fp32 logits (offset so log Z is large and the z term matters), targets
    and per-token weights that include a loss mask (a third of the tokens masked out)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(SEQ, BATCH, VOCAB, generator=gen) * 3 + 20
    target = torch.randint(0, VOCAB, (SEQ, BATCH), generator=gen)
    mask = (torch.rand(SEQ, BATCH, generator=gen) > 0.33).float()
    weights = mask * torch.rand(SEQ, BATCH, generator=gen)
    return logits, target, weights


def _reference(logits: torch.Tensor, target: torch.Tensor, weights: torch.Tensor,
               coeff: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token CE + c·log²Z, log²Z and d(Σ weights·loss)/dlogits, in float64."""
    x = logits.double().requires_grad_()
    log_z = torch.logsumexp(x, dim=-1)
    z = log_z**2
    loss = log_z - x.gather(-1, target.unsqueeze(-1)).squeeze(-1) + coeff * z
    (loss * weights.double()).sum().backward()
    return loss.detach(), z.detach(), x.grad


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.double(), expected, rtol=RTOL, atol=1e-9)


@pytest.mark.parametrize("coeff", COEFFS)
def test_tp1_value_and_gradient_match_the_fp64_reference(coeff: float) -> None:
    logits, target, weights = _problem()
    expected_loss, expected_z, expected_grad = _reference(logits, target, weights, coeff)
    x = logits.clone().requires_grad_()
    loss, z = vocab_parallel_cross_entropy_with_z_loss(x, target, coeff)
    (loss * weights).sum().backward()
    _close(loss, expected_loss)
    _close(z, expected_z)
    _close(x.grad, expected_grad)
    assert torch.equal(x.grad[weights == 0], torch.zeros_like(x.grad[weights == 0]))
    assert not z.requires_grad and loss.dtype == z.dtype == torch.float32


def test_input_logits_are_not_modified() -> None:
    logits, target, weights = _problem()
    x = logits.clone().requires_grad_()
    loss, _ = vocab_parallel_cross_entropy_with_z_loss(x, target, 1e-4)
    (loss * weights).sum().backward()
    assert torch.equal(x.detach(), logits)


def test_bf16_logits_are_computed_in_fp32() -> None:
    logits, target, weights = _problem()
    low = logits.bfloat16().requires_grad_()
    upcast = low.detach().float().requires_grad_()
    loss_low, z_low = vocab_parallel_cross_entropy_with_z_loss(low, target, 1e-2)
    loss_up, z_up = vocab_parallel_cross_entropy_with_z_loss(upcast, target, 1e-2)
    (loss_low * weights).sum().backward()
    (loss_up * weights).sum().backward()
    assert loss_low.dtype == torch.float32 and low.grad.dtype == torch.bfloat16
    assert torch.equal(loss_low, loss_up) and torch.equal(z_low, z_up)
    assert torch.equal(low.grad, upcast.grad.bfloat16())
    _close(loss_low, _reference(upcast.detach(), target, weights, 1e-2)[0])


def test_label_smoothing_is_refused() -> None:
    logits, target, _ = _problem()
    with pytest.raises(ValueError, match="does not support label smoothing"):
        vocab_parallel_cross_entropy_with_z_loss(logits, target, 1e-4, label_smoothing=0.1)


def _megatron_equality_at_tp1(group: dist.ProcessGroup) -> None:
    """c = 0 equals Megatron's cross entropy bit for bit, values and gradients, fp32 and bf16."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits, target, weights = _problem()
    for dtype in (torch.float32, torch.bfloat16):
        a = logits.to(dtype).clone().requires_grad_()
        b = logits.to(dtype).clone().requires_grad_()
        megatron_loss = vocab_parallel_cross_entropy(a * 1, target, tp_group=group)
        (megatron_loss * weights).sum().backward()
        terms = cross_entropy_and_z_loss(b, target, 0.0, group)
        (terms.loss * weights).sum().backward()
        assert torch.equal(terms.loss, megatron_loss), dtype
        assert torch.equal(terms.cross_entropy, megatron_loss), dtype
        assert torch.equal(b.grad, a.grad), dtype


def _tp2_worker(rank: int, init_file: str) -> None:
    """One of two TP ranks: its vocabulary half, checked against the full reference."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    singletons = [dist.new_group([0]), dist.new_group([1])]
    _megatron_equality_at_tp1(singletons[rank])
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    group = parallel_state.get_tensor_model_parallel_group()
    logits, target, weights = _problem(seed=1)
    half = slice(rank * VOCAB // 2, (rank + 1) * VOCAB // 2)
    for coeff in COEFFS:
        expected_loss, expected_z, expected_grad = _reference(logits, target, weights, coeff)
        shard = logits[..., half].clone()
        x = shard.clone().requires_grad_()
        loss, z = vocab_parallel_cross_entropy_with_z_loss(x, target, coeff, group)
        (loss * weights).sum().backward()
        _close(loss, expected_loss)
        _close(z, expected_z)
        _close(x.grad, expected_grad[..., half])
        assert torch.equal(x.detach(), shard)
        # tp_group=None means Megatron's tensor-parallel group once parallel_state is set up.
        y = shard.clone().requires_grad_()
        default_loss, _ = vocab_parallel_cross_entropy_with_z_loss(y, target, coeff)
        (default_loss * weights).sum().backward()
        assert torch.equal(default_loss, loss) and torch.equal(y.grad, x.grad)
        if coeff == 0.0:
            m = shard.clone().requires_grad_()
            megatron_loss = vocab_parallel_cross_entropy(m * 1.0, target, tp_group=group)
            (megatron_loss * weights).sum().backward()
            assert torch.equal(loss, megatron_loss) and torch.equal(x.grad, m.grad)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def test_tp2_over_gloo_matches_the_reference_and_megatron_at_c0(tmp_path: Path) -> None:
    """Two gloo processes; each also checks TP=1 bit-equality with Megatron on its own."""
    mp.spawn(_tp2_worker, args=(str(tmp_path / "rendezvous"),), nprocs=2, join=True)


def test_overwriting_mode_gives_the_same_results() -> None:
    """The training path lets fp32 logits be the working buffer, like Megatron's CE."""
    logits, target, weights = _problem()
    kept, scratch = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    terms = cross_entropy_and_z_loss(kept, target, 1e-4)
    fast = cross_entropy_and_z_loss(scratch * 1.0, target, 1e-4, overwrite_logits=True)
    (terms.loss * weights).sum().backward()
    (fast.loss * weights).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(terms, fast))
    assert torch.equal(kept.grad, scratch.grad)


# -- Megatron adapter -----------------------------------------------------------------------


def _args(**overrides: object) -> SimpleNamespace:
    return SimpleNamespace(**{"z_loss_coeff": 1e-4, "cross_entropy_loss_fusion": False,
                              **overrides})


@pytest.fixture
def adapter_state(monkeypatch: pytest.MonkeyPatch) -> type:
    """Isolate the adapter's per-process state (coefficient and stash)."""
    state = zloss_adapter._State
    monkeypatch.setattr(state, "coeff", 0.0)
    monkeypatch.setattr(state, "stash", None)
    return state


def test_cross_entropy_fusion_is_refused_at_start_up(adapter_state: type) -> None:
    with pytest.raises(SystemExit, match="cannot be combined with --cross-entropy-loss-fusion"):
        zloss_adapter.install(_args(cross_entropy_loss_fusion=True))
    assert not patches.is_applied(zloss_adapter.ZLOSS)


@pytest.mark.parametrize("coeff", [-1e-4, float("nan"), float("inf")])
def test_invalid_coefficient_is_refused(adapter_state: type, coeff: float) -> None:
    with pytest.raises(SystemExit, match="--z-loss-coeff must be a finite number >= 0"):
        zloss_adapter.install(_args(z_loss_coeff=coeff))


def test_coefficient_0_patches_nothing_and_reports_nothing(adapter_state: type) -> None:
    zloss_adapter.install(_args(z_loss_coeff=0.0, cross_entropy_loss_fusion=True))
    assert not patches.is_applied(zloss_adapter.ZLOSS)
    assert zloss_adapter.report_terms(torch.ones(4), torch.tensor(4)) == {}


def test_patched_loss_returns_b_s_and_reports_pure_ce_and_z_once(adapter_state: type) -> None:
    patches.verify(zloss_adapter.ZLOSS)
    adapter_state.coeff = 1e-4
    logits, target, weights = _problem()
    labels = target.transpose(0, 1).contiguous()  # GPTModel passes [b, s] labels
    compute_loss = zloss_adapter.ZLOSS.wrap(None)
    loss = compute_loss(SimpleNamespace(tp_group=None), labels, logits.clone())
    expected = cross_entropy_and_z_loss(logits, target, 1e-4)
    assert loss.shape == (BATCH, SEQ) and torch.equal(loss, expected.loss.T)
    mask = (weights > 0).T.reshape(-1).float()
    report = zloss_adapter.report_terms(mask, mask.sum().to(torch.int))
    assert list(report) == ["lm loss", "z loss"]
    assert torch.equal(report["lm loss"], torch.stack([
        torch.sum(expected.cross_entropy.T.reshape(-1) * mask), mask.sum()]))
    assert torch.equal(report["z loss"][0], torch.sum(expected.z_loss.T.reshape(-1) * mask))
    with pytest.raises(RuntimeError, match="no loss terms stashed"):
        zloss_adapter.report_terms(mask, mask.sum().to(torch.int))


def test_main_head_loss_is_the_last_computed_so_the_stash_holds_it() -> None:
    """The side channel's premise (megatron-core 0.19.2): GPTModel computes the MTP heads'
    losses before the main head's, so the last stashed terms are the main head's."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    source = inspect.getsource(GPTModel._postprocess)
    main_loss = source.rindex("self.compute_language_model_loss(labels, logits)")
    assert source.index("process_mtp_loss(") < main_loss
    assert source.count("compute_language_model_loss(") == 1


def test_patches_command_lists_the_z_loss_patch(capsys: pytest.CaptureFixture[str]) -> None:
    patch_report.main([])
    assert "zloss-output-layer  [feature, verified on 0.19.2]  ok" in capsys.readouterr().out


# -- the real training loop (CPU harness, TP=2) ---------------------------------------------

_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)")


def _per_iteration(run: Run, key: str) -> dict[int, float]:
    values = {}
    for line in run.log.splitlines():
        match = _ITERATION.search(line)
        found = match and re.search(rf"\| {key}: ([0-9.E+-]+) \|", match.group(2) + "|")
        if found:
            values[int(match.group(1))] = float(found.group(1))
    return values


@pytest.mark.timeout(600)
def test_training_with_z_loss_logs_it_and_keeps_lm_loss_pure_ce(tmp_path: Path,
                                                               data_args: list[str]) -> None:
    tp2 = [*data_args, "--tensor-model-parallel-size", "2"]
    plain = launch(tmp_path / "c0", tp2, nproc=2)
    signals = tmp_path / "signals"
    with_z = launch(tmp_path / "c1e-4", [*tp2, "--z-loss-coeff", "1e-4",
                                         "--signals-dir", str(signals)], nproc=2)
    for run in (plain, with_z):
        assert run.returncode == 0, run.log[-4000:]
    lm_plain, lm_z = _per_iteration(plain, "lm loss"), _per_iteration(with_z, "lm loss")
    z = _per_iteration(with_z, "z loss")
    assert sorted(lm_plain) == sorted(lm_z) == sorted(z) == list(range(1, 21))
    assert not _per_iteration(plain, "z loss")
    assert all(value > 0 for value in z.values())
    assert lm_z[1] == lm_plain[1], "same weights and batch: the CE must be identical"
    assert lm_z != lm_plain, "the z term must change the training dynamics"
    # The signals log gets the z loss too. Megatron's console accumulator is not reset after
    # the first iteration, so its iteration-2 figure is the mean of iterations 1 and 2.
    logged = {r.iteration: r.z_loss for r in read_signals(signals / SIGNALS_FILE)}
    assert sorted(logged) == list(range(1, 21))
    assert {k: v for k, v in logged.items() if k != 2} == pytest.approx(
        {k: v for k, v in z.items() if k != 2}, rel=1e-6)
    assert (logged[1] + logged[2]) / 2 == pytest.approx(z[2], rel=1e-6)
    # What was trained is CE + c·log²Z: the sample log's token-summed loss per iteration.
    records = with_z.records()[0]
    for iteration in (1, 20):
        recs = [r for r in records if r.iteration == iteration]
        trained = sum(r.loss_sum for r in recs) / sum(r.num_tokens for r in recs)
        assert trained == pytest.approx(lm_z[iteration] + 1e-4 * z[iteration], rel=1e-5)
