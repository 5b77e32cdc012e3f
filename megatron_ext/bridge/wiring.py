"""Where Megatron-Bridge's loop meets the installed features: one function per mechanism.

Bridge runs its own training loop (``megatron.bridge.training.train``), not Megatron's, so
the four loop hooks the overlay patches into Megatron (``setup_model_and_optimizer``,
``training_log``, ``save_checkpoint_and_time``) are never called there. Each hook is reached
through a public Bridge mechanism instead, and always through the same callers as the
overlay's own GPT step (:mod:`megatron_ext.loop.hooks`), so the features run unchanged:

=====================  ======================================================================
``on_model_built``     ``config.model.register_pre_wrap_hook`` (:func:`loop.hooks.pre_wrap_hook`)
``on_setup``           ``Callback`` event ``on_train_start`` (model chunks, optimizer)
``on_train_dataset``   registry ``bridge-dataset-provider`` (:func:`with_train_dataset_hook`)
``on_batch``           the forward step's data iterator (:class:`ObservedBatches`:
                       :func:`loop.hooks.read_batch`, before Bridge's get_batch drops
                       ``dataset_id``)
``on_loss``            the forward step's loss function (Bridge's loss partial, observed)
``before_grad_norm``   megatron-core's optimizer (registry ``hook-before-grad-norm``: Bridge
                       steps megatron-core's ChainedOptimizer)
``after_step``         ``Callback`` event ``on_train_step_end`` (:func:`step_record`)
``on_checkpoint``      ``CheckpointConfig.custom_manager_class``
                       (:mod:`megatron_ext.bridge.checkpoints`)
=====================  ======================================================================

The features keep the Megatron-style args they were installed with
(:mod:`megatron_ext.bridge.args`); the callbacks keep the loop counters on them current
(``curr_iteration``, ``iteration``, consumed and skipped samples) from Bridge's
``train_state``, as Megatron's loop does on its global args. No Bridge import at module level.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from megatron_ext.common.features import Feature, FeatureSet, LossInputs, MicroBatch, StepRecord
from megatron_ext.loop import hooks


def with_train_dataset_hook(
    original: Callable[..., Any], features: FeatureSet
) -> Callable[..., Any]:
    """Wrapper of ``bridge-dataset-provider``: the provider Bridge picks, then
    ``on_train_dataset`` on its train dataset."""

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
    """The data iterator Bridge's ``get_batch`` reads from: each ``next`` is
    :func:`megatron_ext.loop.hooks.read_batch` (``on_batch`` sees the batch whole, with its
    ``dataset_id``, and the drill may change its tokens), once per micro-batch."""

    def __init__(self, features: FeatureSet, data: Iterator[Any], micro_batch: MicroBatch) -> None:
        self.features, self.data, self.micro_batch = features, data, micro_batch

    def __iter__(self) -> ObservedBatches:
        return self

    def __next__(self) -> dict[str, Any]:
        return hooks.read_batch(self.features, self.data, self.micro_batch)


def micro_batch(features: FeatureSet, model: Any) -> MicroBatch:
    """The micro-batch ``model`` is about to run (iteration 1-indexed, as Megatron logs it)."""
    from megatron.core import parallel_state

    return MicroBatch(
        iteration=features.args.curr_iteration + 1,
        training=model.training,
        dp_rank=parallel_state.get_data_parallel_rank(),
    )


def forward_step(
    features: FeatureSet,
    bridge_step: Callable[..., tuple[Any, Any]],
    state: Any,
    data_iterator: Any,
    model: Any,
    return_schedule_plan: bool = False,
) -> tuple[Any, Callable[[Any], Any]]:
    """The forward step handed to Bridge (bound with :func:`functools.partial`; its first
    free parameter is named ``state``, so Bridge injects its GlobalState): Bridge's GPT step
    reading through :class:`ObservedBatches`, its loss function observed by ``on_loss``
    (registry assumption ``bridge-gpt-forward-step``: the partial's first argument is the
    loss mask)."""
    batch = micro_batch(features, model)
    data = None if data_iterator is None else ObservedBatches(features, data_iterator, batch)
    output, loss_function = bridge_step(state, data, model, return_schedule_plan)
    loss_mask = loss_function.args[0] if isinstance(loss_function, partial) else None
    if loss_mask is None:
        return output, loss_function
    return output, partial(observed_loss, features, batch, loss_function, loss_mask)


def observed_loss(
    features: FeatureSet,
    batch: MicroBatch,
    loss_function: Callable[[Any], tuple[Any, Any, dict[str, Any]]],
    loss_mask: Any,
    output_tensor: Any,
) -> tuple[Any, Any, dict[str, Any]]:
    """Bridge's ``(token-summed loss, token count, report)``, then ``on_loss`` with the
    per-token output and the mask: the features' entries join the report."""
    loss, num_tokens, report = loss_function(output_tensor)
    inputs = LossInputs(batch, output_tensor, loss_mask.view(-1).float(), loss, num_tokens)
    return loss, num_tokens, hooks.loss_report(features, inputs, dict(report))


# -- callbacks (Bridge's CallbackManager.register) --------------------------------------------


def sync_counters(args: Any, state: Any, after_step: bool) -> None:
    """Megatron's loop counters on the features' args, from Bridge's ``train_state``: during
    an iteration (``after_step=False``) as Megatron has them in its forward steps, at its end
    as Megatron has them in ``training_log`` (the step and its samples counted)."""
    train = state.train_state
    args.curr_iteration = train.step
    args.iteration = train.step + (1 if after_step else 0)
    args.consumed_train_samples = train.consumed_train_samples + (
        args.global_batch_size if after_step else 0
    )
    args.skipped_train_samples = train.skipped_train_samples


def on_train_start(features: FeatureSet, context: Any) -> None:
    """``on_setup``: the wrapped model chunks and the optimizer exist. The tokenizer's
    vocabulary size, which Megatron puts on its args when it builds the tokenizer, is known
    from here (Bridge built it in its setup)."""
    sync_counters(features.args, context.state, after_step=False)
    share_writers(context.state)
    features.args.vocab_size = context.state.tokenizer.vocab_size
    features.args.padded_vocab_size = context.state.cfg.model.vocab_size
    model = context.model if isinstance(context.model, list) else [context.model]
    for feature in features.using(Feature.on_setup):
        feature.on_setup(model, context.optimizer)


def share_writers(state: Any) -> None:
    """Bridge's TensorBoard and W&B writers (on its state object, made on the last rank, the
    features' writing rank) as Megatron's global writers, which the features write their
    scalars to (bucket norms, per-source losses). Registry ``bridge-writers``."""
    from megatron.training import global_vars

    global_vars._GLOBAL_TENSORBOARD_WRITER = state.tensorboard_logger
    global_vars._GLOBAL_WANDB_WRITER = state.wandb_logger


def on_train_step_start(features: FeatureSet, context: Any) -> None:
    sync_counters(features.args, context.state, after_step=False)


def step_record(features: FeatureSet, context: Any) -> StepRecord:
    """The iteration as Megatron's ``training_log`` would have seen it, from Bridge's callback
    context (its reduced losses, grad norm, skip flag) and the optimizer (learning rate, loss
    scale); what Bridge does not report (params norm, zeros, attention logit) is None, which
    the features read as "not measured" (telemetry measures the params norm itself)."""
    optimizer = context.optimizer
    learning_rate = None
    for group in optimizer.param_groups:
        if group and not group.get("is_decoupled_lr", False):
            learning_rate = group["lr"]
    scale = optimizer.get_loss_scale()
    grad_norm = context.grad_norm
    return StepRecord(
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


def on_train_step_end(features: FeatureSet, context: Any) -> None:
    """``after_step`` in hook order (the spike detector last: a rollback decision ends the
    process here, before Bridge's interval save of this iteration)."""
    sync_counters(features.args, context.state, after_step=True)
    record = step_record(features, context)
    for feature in features.using(Feature.after_step):
        feature.after_step(record)


def register_callbacks(
    manager: Any, features: FeatureSet, final_save: Callable[[Any], None]
) -> None:
    """The features' events on the user's (or a new) ``CallbackManager``, after the user's own
    callbacks; the run's features also go on its ``user_state`` for the checkpoint manager."""
    manager.user_state["megatron_ext_features"] = features
    manager.register("on_train_start", partial(on_train_start, features))
    manager.register("on_train_step_start", partial(on_train_step_start, features))
    manager.register("on_train_step_end", partial(on_train_step_end, features))
    manager.register("on_train_end", final_save)


def with_weight_decay(provider: Any, policy: Any) -> Any:
    """The config's ``OptimizerConfigOverrideProvider`` with the weight-decay feature's
    multipliers added to what it builds (Bridge's 1-D/bias defaults kept)."""
    from megatron_ext.weight_decay.adapter import extend_overrides

    original = provider.build_config_overrides

    def build_config_overrides(context: Any) -> Any:
        return extend_overrides(original(context) or {}, policy)

    provider.build_config_overrides = build_config_overrides
    return provider
