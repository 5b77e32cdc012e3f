"""Where Megatron-Bridge's loop meets the installed features, one function per mechanism:
Bridge's callbacks, forward step, checkpoint manager or a registry entry, through the same
:mod:`megatron_ext.registry.hooks` callers as the overlay's GPT step (docs/bridge.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch

from megatron_ext.bridge import checkpoints
from megatron_ext.common.errors import StartupError
from megatron_ext.common.features import Feature, FeatureSet, MicroBatch, StepRecord
from megatron_ext.fork.overlay import observed_loss
from megatron_ext.registry import hooks
from megatron_ext.telemetry.validation import ValidationFeature


def with_train_dataset_hook(
    original: Callable[..., Any], features: FeatureSet
) -> Callable[..., Any]:
    """Wrapper of ``bridge-dataset-provider``: ``on_train_dataset`` on the train dataset."""

    def get_dataset_provider(dataset_config: Any) -> Callable[..., Any]:
        provider = original(dataset_config)

        def provide(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
            train, valid, test = provider(*args, **kwargs)
            if train is not None:
                for feature in features.using(Feature.on_train_dataset):
                    train = feature.on_train_dataset(train)
            return train, valid, test

        return provide

    return get_dataset_provider


class ObservedBatches:
    """The data iterator Bridge's ``get_batch`` reads on every TP rank: TP rank 0 reads through
    :func:`hooks.read_batch` (``on_batch`` sees the batch once per DP rank, ``dataset_id``
    included), and its tokens and labels, which the drill may change, replace the others'."""

    def __init__(self, features: FeatureSet, data: Iterator[Any], micro_batch: MicroBatch) -> None:
        self.features, self.data, self.micro_batch = features, data, micro_batch

    def __iter__(self) -> ObservedBatches:
        return self

    def __next__(self) -> dict[str, Any]:
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        if mpu.get_tensor_model_parallel_world_size() == 1:
            return hooks.read_batch(self.features, self.data, self.micro_batch)
        if mpu.get_tensor_model_parallel_rank() == 0:
            batch = hooks.read_batch(self.features, self.data, self.micro_batch)
        else:
            batch = next(self.data)
        for key in ("tokens", "labels"):  # on the device, where Bridge moves them anyway
            if batch.get(key) is not None:
                batch[key] = batch[key].cuda(non_blocking=True)
                dist.broadcast(
                    batch[key],
                    src=mpu.get_tensor_model_parallel_src_rank(),
                    group=mpu.get_tensor_model_parallel_group(),
                )
        return batch


def forward_step(
    features: FeatureSet,
    user_step: Callable[..., tuple[Any, Any]],
    wants_state: bool,
    state: Any,
    data_iterator: Any,
    model: Any,
    return_schedule_plan: bool = False,
) -> tuple[Any, Callable[[Any], Any]]:
    """The forward step handed to Bridge (``state`` first, so Bridge injects its GlobalState):
    the user's step (given the state when ``wants_state``) reading through
    :class:`ObservedBatches`, its loss partial (the loss mask first) observed."""
    from megatron.core import parallel_state

    batch = MicroBatch(
        features.args.curr_iteration + 1, model.training, parallel_state.get_data_parallel_rank()
    )
    data = None if data_iterator is None else ObservedBatches(features, data_iterator, batch)
    step = partial(user_step, state) if wants_state else user_step
    output, loss_function = step(data, model, *((True,) if return_schedule_plan else ()))
    if return_schedule_plan:  # a schedule plan, not a forward: nothing to observe
        return output, loss_function
    loss_mask = _loss_mask(loss_function)
    if loss_mask is None:  # a pipeline stage without the loss reads no mask
        return output, loss_function
    if not isinstance(loss_mask, torch.Tensor):
        raise StartupError(
            f"megatron-ext: the forward step {getattr(user_step, '__name__', user_step)!r} "
            "returns a loss function whose loss mask cannot be read; return "
            "functools.partial(loss_func, loss_mask, ...) as Bridge's gpt_step does (the "
            "per-sample loss, per-source loss and worst-rank loss read the mask)"
        )
    return output, partial(observed_loss, features, batch, loss_function, loss_mask)


def _loss_mask(loss_function: Any) -> Any:
    """The mask Bridge's loss partials carry (first argument, or ``loss_mask=`` as its
    distillation loss has it); False when the function carries none."""
    if not isinstance(loss_function, partial):
        return False
    if loss_function.args:
        return loss_function.args[0]
    return loss_function.keywords.get("loss_mask", False)


def sync_counters(args: Any, state: Any, after_step: bool) -> None:
    """Megatron's loop counters on the features' args from Bridge's ``train_state``: as in
    Megatron's forward steps, or (``after_step``) as in its ``training_log``."""
    train = state.train_state
    args.curr_iteration = train.step
    args.iteration = train.step + (1 if after_step else 0)
    args.consumed_train_samples = train.consumed_train_samples + (
        args.global_batch_size if after_step else 0
    )
    args.skipped_train_samples = train.skipped_train_samples


def on_train_start(features: FeatureSet, context: Any) -> None:
    """``on_setup``: the wrapped model chunks and the optimizer exist, and the tokenizer's
    vocabulary size is known."""
    sync_counters(features.args, context.state, after_step=False)
    share_writers(context.state)
    features.args.vocab_size = context.state.tokenizer.vocab_size
    features.args.padded_vocab_size = context.state.cfg.model.vocab_size
    model = context.model if isinstance(context.model, list) else [context.model]
    for feature in features.using(Feature.on_setup):
        feature.on_setup(model, context.optimizer)


def share_writers(state: Any) -> None:
    """Bridge's TensorBoard and W&B writers (on its state, last rank) as Megatron's global
    writers, where the features write their scalars. Registry ``bridge-writers``."""
    from megatron.training import global_vars

    global_vars._GLOBAL_TENSORBOARD_WRITER = state.tensorboard_logger
    global_vars._GLOBAL_WANDB_WRITER = state.wandb_logger


def on_train_step_start(features: FeatureSet, context: Any) -> None:
    sync_counters(features.args, context.state, after_step=False)


def on_train_step_end(features: FeatureSet, context: Any) -> None:
    """``after_step`` in hook order (a rollback ends the process here, before Bridge's interval
    save), the iteration as Megatron's ``training_log`` sees it; what Bridge does not report
    (params norm, zeros, attention logit) is None, "not measured"."""
    sync_counters(features.args, context.state, after_step=True)
    optimizer = context.optimizer
    learning_rate = None
    for group in optimizer.param_groups:
        if group and not group.get("is_decoupled_lr", False):
            learning_rate = group["lr"]
    scale = optimizer.get_loss_scale()
    grad_norm = context.grad_norm
    record = StepRecord(
        iteration=features.args.iteration,
        losses=dict(context.loss_dict or {}),
        learning_rate=learning_rate,
        loss_scale=float(scale.item() if hasattr(scale, "item") else scale),
        skipped_iter=bool(context.skipped_iter),
        grad_norm=None if grad_norm is None else float(grad_norm),
        params_norm=None,
        num_zeros=None,
        max_attention_logit=None,
    )
    for feature in features.using(Feature.after_step):
        feature.after_step(record)


def on_evaluation_start(feature: ValidationFeature, test: bool, context: Any) -> None:
    """``on_eval_start`` / ``on_test_start``: per-dataset validation's set begins (its split,
    the iteration, fresh sums)."""
    state = context.state
    step = state.train_state.step
    prefix = f"iteration {step}" + (" on test set" if test else "")
    feature.begin(prefix, step, not state.cfg.validation.skip_train)
    feature.start_set()


def on_evaluation_end(feature: ValidationFeature, context: Any) -> None:
    """``on_eval_end`` / ``on_test_end``: Bridge's averaged loss dict (before it prints it);
    the members' sums reduced, checked against it and reported."""
    feature.end_set(context.total_loss_dict, timelimit=False)
    feature.report()


def register_callbacks(
    manager: Any, features: FeatureSet, final_save: Callable[[Any], None]
) -> None:
    """The features' events on the ``CallbackManager``, after the user's callbacks; the
    features also go on its ``user_state`` for the checkpoint manager."""
    manager.user_state[checkpoints.FEATURES_KEY] = features
    manager.register("on_train_start", partial(on_train_start, features))
    manager.register("on_train_step_start", partial(on_train_step_start, features))
    manager.register("on_train_step_end", partial(on_train_step_end, features))
    manager.register("on_train_end", final_save)
    for feature in features.features:
        if isinstance(feature, ValidationFeature) and feature.sets:
            for event, test in (("eval", False), ("test", True)):
                manager.register(f"on_{event}_start", partial(on_evaluation_start, feature, test))
                manager.register(f"on_{event}_end", partial(on_evaluation_end, feature))


def with_weight_decay(provider: Any, policy: Any) -> None:
    """The config's ``OptimizerConfigOverrideProvider`` with the weight-decay multipliers
    added to what it builds."""
    from megatron_ext.weight_decay.adapter import extend_overrides

    original = provider.build_config_overrides

    def build_config_overrides(context: Any) -> Any:
        return extend_overrides(original(context) or {}, policy)

    provider.build_config_overrides = build_config_overrides
