"""Spike rules used by other frameworks, re-implemented faithfully as streaming anchors.

Each class exposes ``observe(iteration, loss, grad_norm) -> bool`` (True = the rule flags
this step) and takes the source's defaults.  They replay a logged curve one step at a
time, so they see the *logged* (usually globally averaged) loss / grad norm; where the
original rule looks at a different quantity (per-micro-batch, per-rank, per-bucket) the
docstring says so.  Pure Python, no project imports.
"""

from __future__ import annotations

import math
from collections import deque


class MegatronSpikyLoss:
    """Megatron-LM spiky-loss / large-grads check.

    Source: NVIDIA/Megatron-LM ``pretrain_gpt.py``
    (commit 000ab9d6719e22605b0619b8fcca713b1ce4e969):
    ``SPIKY_LOSS_FACTOR = 10``; with ``--check-for-spiky-loss`` (store_true, off by default)
    ``loss_func`` calls ``validate_result(result=loss, rejection_func=partial(
    rerun_state_machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss"),
    message="Spiky loss", tolerance=0.0, fatal=False)``.
    Rule: ``megatron/core/rerun_state_machine.py``
    (commit 00caa53af30912914981c86f39db123961678bbd),
    ``RerunStateMachine.is_unexpectedly_large(result, threshold, context, num_samples=100,
    resample=False)``: ``value = abs(result)``; NaN/Inf return False and are not sampled; the
    first ``num_samples`` finite values only update ``max_values[context]`` (never flagged);
    afterwards flag iff ``value >= max_value * threshold``.  The max is frozen after the
    first 100 samples (usually dominated by the ~ln(vocab) loss at step 0).

    Differences from the original: Megatron applies it to each micro-batch's *summed*
    token loss on each rank before the DP all-reduce (same ratio as the mean when the
    token count is constant); in VALIDATE_RESULTS mode the very first iteration is not
    validated, while in the default DISABLED mode the rejection function still runs every
    call.  ``signal="grad_norm"`` mimics the ``context="grads"`` variant in
    ``megatron/core/distributed/param_and_grad_buffer.py`` (``check_for_large``,
    threshold=10), which the original applies to each bucket's local grad norm.
    """

    def __init__(
        self, threshold: float = 10.0, num_samples: int = 100, signal: str = "loss"
    ) -> None:
        assert signal in ("loss", "grad_norm")
        self.threshold = threshold
        self.num_samples = num_samples
        self.signal = signal
        self.count = 0
        self.max_value = 0.0

    def observe(self, iteration: int, loss: float, grad_norm: float | None) -> bool:
        x = loss if self.signal == "loss" else grad_norm
        if x is None:
            return False
        value = math.fabs(x)
        if math.isnan(value) or math.isinf(value):
            return False  # "Ignore NaNs and Infs. They should be checked separately."
        if self.count < self.num_samples:
            self.count += 1
            self.max_value = max(self.max_value, value)
            return False
        return value >= self.max_value * self.threshold


class OLMoCoreStabilityMonitor:
    """OLMo-core ``StabilityMonitorCallback``.

    Source: allenai/OLMo-core ``src/olmo_core/train/callbacks/stability_monitor.py``
    (commit fa6c5014c9f6e9ee789da2d9c20d5126fee8df0d).  Defaults: ``window_size=128``,
    ``threshold_std=6.0`` (``rolling_window=10000`` only feeds the SpikeScore metric).
    In ``pre_log_metrics`` for each of ``train/CE loss`` and ``optim/total grad norm``:
    spike iff the history holds ``window_size`` values and ``value > mean + 6 * std``
    (population std; no check when ``std < 1e-10``); the value is then appended to the
    history whether or not it spiked (spikes and NaNs enter the window).  A step counts
    as a spike if the loss OR the grad norm spikes.  It only records a metric
    (``spike/SpikeScore``); it never skips or stops.  A missing metric is not appended.
    Consequence: one NaN makes the mean NaN, so that signal cannot flag again until the
    NaN leaves the 128-value window.
    """

    def __init__(self, window_size: int = 128, threshold_std: float = 6.0) -> None:
        self.window_size = window_size
        self.threshold_std = threshold_std
        self.loss_history: list[float] = []
        self.grad_norm_history: list[float] = []

    def _is_spike(self, value: float, history: list[float]) -> bool:
        if len(history) < self.window_size:
            return False
        mean = sum(history) / len(history)
        std = math.sqrt(sum((x - mean) ** 2 for x in history) / len(history))
        if std < 1e-10:
            return False
        return value > mean + self.threshold_std * std

    def _append(self, history: list[float], value: float) -> None:
        history.append(value)
        if len(history) > self.window_size:
            history.pop(0)

    def observe(self, iteration: int, loss: float, grad_norm: float | None) -> bool:
        loss_spike = grad_spike = False
        if loss is not None:
            loss_spike = self._is_spike(loss, self.loss_history)
            self._append(self.loss_history, loss)
        if grad_norm is not None:
            grad_spike = self._is_spike(grad_norm, self.grad_norm_history)
            self._append(self.grad_norm_history, grad_norm)
        return loss_spike or grad_spike


class LightningSpikeDetection:
    """Lightning Fabric ``SpikeDetection``.

    Source: Lightning-AI/pytorch-lightning ``src/lightning/fabric/utilities/spike.py``
    (commit 0c94c0ea241f579748007024427f4ed0dd12f1ee).  Defaults: ``mode="min"``,
    ``window=10``, ``warmup=1``, ``atol=None``, ``rtol=2.0``, ``exclude_batches_path=None``
    (-> ``./skip_batches.json``), ``finite_only=True``.  Per batch (``batch_idx`` from 0):
    checked only when ``batch_idx >= warmup``; running mean = torchmetrics
    ``Running(MeanMetric, window=10)`` over the last 10 *accepted* losses; ``last_val``
    starts at 0.0.  Spike iff (finite_only and loss non-finite) or (loss - last_val > 0 in
    "min" mode and ``|loss - mean| >= atol`` (if set) and ``|loss - mean| >= |rtol * mean|``),
    i.e. loss >= 3x the running mean with the defaults.  On a spike it writes
    ``[batch_idx - 1, batch_idx]`` to the skip file and raises ``TrainingSpikeException``;
    the stats are NOT updated with the spiking value.  Here we flag and keep replaying
    (no update), as if the run had been resumed skipping that batch.  Notes: the
    docstring describes ``finite_only`` the other way round from the code (code: True ->
    non-finite IS a spike); MeanMetric's default ``nan_strategy="warn"`` drops NaNs, but
    the Running window slot is still consumed.  The original runs per rank, per batch.
    """

    def __init__(
        self,
        mode: str = "min",
        window: int = 10,
        warmup: int = 1,
        atol: float | None = None,
        rtol: float | None = 2.0,
        finite_only: bool = True,
    ) -> None:
        assert mode in ("min", "max")
        self.mode, self.warmup, self.atol, self.rtol, self.finite_only = (
            mode,
            warmup,
            atol,
            rtol,
            finite_only,
        )
        self.window: deque[tuple[float, float]] = deque(maxlen=window)  # (sum, weight) per update
        self.last_val = 0.0
        self.batch_idx = -1
        self.bad_batches: list[int] = []

    def _running_mean(self) -> float:
        w = sum(c for _, c in self.window)
        return sum(s for s, _ in self.window) / w if w else math.nan

    def _is_spike(self, loss: float) -> bool:
        running = self._running_mean()
        diff = loss - self.last_val
        if self.finite_only and not math.isfinite(loss):
            return True
        better = diff <= 0.0 if self.mode == "min" else diff >= 0.0
        if better:
            return False
        atol_ok = self.atol is None or abs(loss - running) >= abs(self.atol)
        rtol_ok = self.rtol is None or abs(loss - running) >= abs(self.rtol * running)
        return bool(atol_ok and rtol_ok)

    def observe(self, iteration: int, loss: float, grad_norm: float | None) -> bool:
        self.batch_idx += 1
        spike = self.batch_idx >= self.warmup and self._is_spike(loss)
        if spike:
            self.bad_batches.extend([self.batch_idx - 1, self.batch_idx])
            return True
        if self.finite_only or math.isfinite(loss):
            self.window.append((0.0, 0.0) if math.isnan(loss) else (loss, 1.0))
            self.last_val = loss
        return False


class ZClipZScore:
    """ZClip z-score spike rule on the gradient norm.

    Source: bluorion-com/ZClip ``zclip/zclip.py`` (commit 584ce4f5a4aabab59e7df1dbaffc26a44df39dc1).
    Defaults: ``alpha=0.97``, ``z_thresh=2.5``, ``max_grad_norm=1.0``, ``eps=1e-6``,
    ``warmup_steps=25``, ``mode="zscore"``, ``clip_option="adaptive_scaling"``,
    ``clip_factor=1.0``, ``skip_update_on_spike=False``.  The first 25 grad norms fill a
    buffer (no clipping beyond ``max_grad_norm``); at the 25th, mean and population
    variance initialise the EMA.  Then ``z = (g - mean) / (std + eps)``; spike iff
    ``z > z_thresh`` ("percentile" mode: ``g > mean + z_thresh * std``).  On a spike the
    clip value is ``mean + z_thresh*std/(z/z_thresh) * clip_factor`` (adaptive_scaling) or
    ``mean``; the EMA is updated with that clip value (not with the final ``min(clip,
    max_grad_norm)``), else with ``g``: ``mean = a*mean + (1-a)*x`` then ``var = a*var +
    (1-a)*(x - new_mean)**2`` (note: the already-updated mean).  A NaN norm is not a
    spike and poisons the EMA, so nothing is flagged afterwards.  ZClip computes the norm
    itself from the gradients (every step); here a step without a logged grad norm is
    ignored.  It never looks at the loss.
    """

    def __init__(
        self,
        alpha: float = 0.97,
        z_thresh: float = 2.5,
        eps: float = 1e-6,
        warmup_steps: int = 25,
        mode: str = "zscore",
        clip_option: str = "adaptive_scaling",
        clip_factor: float = 1.0,
        skip_update_on_spike: bool = False,
    ) -> None:
        assert mode in ("zscore", "percentile") and clip_option in ("mean", "adaptive_scaling")
        self.alpha, self.z_thresh, self.eps, self.warmup_steps = alpha, z_thresh, eps, warmup_steps
        self.mode, self.clip_option, self.clip_factor = mode, clip_option, clip_factor
        self.skip_update_on_spike = skip_update_on_spike
        self.buffer: list[float] = []
        self.mean: float | None = None
        self.var: float | None = None

    def _clip_val(self, g: float) -> float | None:
        assert self.mean is not None and self.var is not None
        std = self.var**0.5
        if self.mode == "percentile":
            threshold = self.mean + self.z_thresh * std
            return threshold if g > threshold else None
        z = (g - self.mean) / (std + self.eps)
        if z > self.z_thresh:
            if self.clip_option == "adaptive_scaling":
                eta = z / self.z_thresh
                return (self.mean + (self.z_thresh * std) / eta) * self.clip_factor
            return self.mean
        return None

    def observe(self, iteration: int, loss: float, grad_norm: float | None) -> bool:
        if grad_norm is None:
            return False
        if self.mean is None:
            self.buffer.append(grad_norm)
            if len(self.buffer) >= self.warmup_steps:
                self.mean = sum(self.buffer) / len(self.buffer)
                self.var = sum((x - self.mean) ** 2 for x in self.buffer) / len(self.buffer)
                self.buffer = []
            return False
        clip_val = self._clip_val(grad_norm)
        if clip_val is not None and self.skip_update_on_spike:
            return True
        x = clip_val if clip_val is not None else grad_norm
        self.mean = self.alpha * self.mean + (1 - self.alpha) * x
        self.var = self.alpha * self.var + (1 - self.alpha) * (x - self.mean) ** 2
        return clip_val is not None


ANCHORS = {
    "megatron_spiky_loss": MegatronSpikyLoss,
    "olmo_core_stability": OLMoCoreStabilityMonitor,
    "lightning_spike_detection": LightningSpikeDetection,
    "zclip_zscore": ZClipZScore,
}
