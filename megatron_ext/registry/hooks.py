"""Where Megatron's loop and the training script call the installed features: the wrappers of
the registry's ``hook-*`` patches (bound to the run's FeatureSet) and the functions a script's
side calls for ``on_model_built``, ``on_train_dataset``, ``on_batch`` and ``on_loss``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

from megatron_ext.common.features import (
    DATASET_ID_KEY,
    Feature,
    FeatureSet,
    LossInputs,
    MicroBatch,
    StepRecord,
)

# The feature report entries an evaluation keeps: those whose exp() is a perplexity.
EVALUATED = ("lm loss",)


def pre_wrap_hook(features: FeatureSet) -> Callable[[list[Any]], list[Any]]:
    """The config container's ``pre_wrap_hooks`` entry: the built, unwrapped model chunks."""

    def on_model_built(model: list[Any]) -> list[Any]:
        model_built(features, model)
        return model

    return on_model_built


def model_built(features: FeatureSet, chunks: list[Any]) -> None:
    """``on_model_built`` on this rank's built, unwrapped chunks, and the record that it ran
    (:meth:`FeatureSet.check_model_built`): the one caller, whichever way the model came."""
    for feature in features.using(Feature.on_model_built):
        feature.on_model_built(chunks)
    features.built.hook_ran = True


def wrap_setup(original: Callable[..., Any], features: FeatureSet) -> Callable[..., Any]:
    users = features.using(Feature.on_setup)

    def setup_model_and_optimizer(*args: Any, **kwargs: Any) -> Any:
        model, optimizer, scheduler = original(*args, **kwargs)
        for feature in users:
            feature.on_setup(model, optimizer)
        return model, optimizer, scheduler

    return setup_model_and_optimizer


def wrap_get_grad_norm(
    original: Callable[[Any], Any], features: FeatureSet
) -> Callable[[Any], Any]:
    users = features.using(Feature.before_grad_norm)

    def get_grad_norm(self: Any) -> Any:
        for feature in users:
            feature.before_grad_norm(self)
        return original(self)

    return get_grad_norm


def wrap_training_log(original: Callable[..., Any], features: FeatureSet) -> Callable[..., Any]:
    users = features.using(Feature.after_step)
    # Megatron passes these positionally; the registry pins the signature they are bound by.
    signature = inspect.signature(original)

    def training_log(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        a = signature.bind(*args, **kwargs).arguments
        record = StepRecord(
            iteration=a["iteration"],
            losses=dict(a["loss_dict"]),
            learning_rate=a["learning_rate"],
            loss_scale=float(a["loss_scale"]),
            skipped_iter=bool(a["skipped_iter"]),
            grad_norm=a["grad_norm"],
            params_norm=a["params_norm"],
            num_zeros=a["num_zeros_in_grad"],
            max_attention_logit=a["max_attention_logit"],
        )
        for feature in users:
            feature.after_step(record)
        return result

    return training_log


def wrap_save_checkpoint(original: Callable[..., Any], features: FeatureSet) -> Callable[..., Any]:
    users = features.using(Feature.on_checkpoint)

    def save_checkpoint_and_time(iteration: int, *args: Any, **kwargs: Any) -> Any:
        # Every feature hears about the save, even after one vetoed it.
        if not all([feature.on_checkpoint(iteration) for feature in users]):
            return None
        return original(iteration, *args, **kwargs)

    return save_checkpoint_and_time


# -- the script's hooks ----------------------------------------------------------------------


def chunk_built(features: FeatureSet, chunk: Any) -> None:
    """A model provider built ``chunk`` (``get_model`` calls it once per virtual stage, before
    mixed precision and DDP); after this rank's last one, ``on_model_built`` on all of them."""
    built = features.built
    built.chunks.append(chunk)
    if len(built.chunks) == (features.args.virtual_pipeline_model_parallel_size or 1):
        model_built(features, list(built.chunks))


def observed_model_provider(
    provider: Callable[..., Any], features: FeatureSet, *args: Any, **kwargs: Any
) -> Any:
    """A script's own model provider, as ``get_model`` calls it (registry
    ``script-model-provider``), then :func:`chunk_built` on what it built."""
    chunk = provider(*args, **kwargs)
    chunk_built(features, chunk)
    return chunk


def datasets(
    features: FeatureSet,
    provider: Callable[..., tuple[Any, Any, Any]],
    train_val_test_num_samples: list[int],
    vp_stage: int | None = None,
) -> tuple[Any, Any, Any]:
    """The script's dataset provider (given ``vp_stage`` only when Megatron gives one), then
    ``on_train_dataset`` on its train dataset where it is not None (data-reading ranks)."""
    features.check_model_built()  # pretrain builds the model before the datasets
    kwargs = {} if vp_stage is None else {"vp_stage": vp_stage}
    train, valid, test = provider(train_val_test_num_samples, **kwargs)
    if train is not None:
        for feature in features.using(Feature.on_train_dataset):
            train = feature.on_train_dataset(train)
    return train, valid, test


def read_batch(
    features: FeatureSet, data_iterator: Iterator[dict[str, Any]], micro_batch: MicroBatch
) -> dict[str, Any]:
    """TP rank 0 of a data-reading stage: the next micro-batch after ``on_batch`` saw it (and
    may have changed it); its blend member ids go on ``micro_batch`` first."""
    batch = next(data_iterator)
    micro_batch.reads_data = True
    micro_batch.dataset_ids = batch.get(DATASET_ID_KEY)
    for feature in features.using(Feature.on_batch):
        feature.on_batch(batch, micro_batch)
    return batch


def loss_report(features: FeatureSet, inputs: LossInputs, report: dict[str, Any]) -> dict[str, Any]:
    """The script's loss ``report`` with the entries ``on_loss`` adds; in evaluation only
    :data:`EVALUATED` ones (Megatron prints exp(value) of each as a perplexity)."""
    for feature in features.using(Feature.on_loss):
        added = feature.on_loss(inputs) or {}
        report.update(
            {k: v for k, v in added.items() if inputs.micro_batch.training or k in EVALUATED}
        )
    return report
