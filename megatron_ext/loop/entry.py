"""How a training script drives each megatron-core's ``pretrain``: one runner per form of the
registry's ``entry-point`` (0.19: the GPT config container; 0.18: a container and a model
provider; 0.17: classic ``pretrain``, which parses the arguments again, so they are parsed once
and handed to ``initialize_megatron``: registry ``classic-pretrain-parsed-args``). Every runner
installs the features on the args object that is Megatron's global args.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from megatron_ext.common.errors import StartupError
from megatron_ext.common.features import FeatureSet
from megatron_ext.common.versions import V17, V18, V19
from megatron_ext.loop import gpt_model, gpt_step, install
from megatron_ext.loop.step import Step
from megatron_ext.registry import table as registry

Broadcast = Callable[..., dict[str, Any]]


def overlay_step() -> Step:
    """``pretrain_gpt_ext.py``'s part: the overlay's GPT step, dataset provider and model."""
    from megatron.core.enums import ModelType

    return Step(
        bind=gpt_step.bind,
        check=gpt_step.check_supported,
        model_type=ModelType.encoder_or_decoder,
        get_embedding_ranks=gpt_step.get_embedding_ranks,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
    )


def _args_provider(step: Step, parser: Any) -> Any:
    """Megatron's ``extra_args_provider``: the script's flags, then the overlay's group."""
    if step.extra_args_provider is not None:
        parser = step.extra_args_provider(parser)
    return install.add_megatron_ext_args(parser)


def _parse_and_wrap(step: Step) -> tuple[Any, Callable[..., Any], Any]:
    """The parsed args, then ``pretrain`` and its store from the in-process-restart wrapper."""
    from megatron.training import inprocess_restart, pretrain
    from megatron.training.arguments import parse_and_validate_args

    # Parse before Megatron's in-process-restart wrapper: it parses sys.argv without the
    # megatron-ext group, so `--help` would print (and exit) without the overlay's flags.
    args = parse_and_validate_args(
        extra_args_provider=partial(_args_provider, step), args_defaults=step.args_defaults
    )
    return args, *inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)


def _install(step: Step, args: Any) -> FeatureSet:
    """The features, installed on ``args`` once they are Megatron's global args."""
    from megatron.training import get_args

    if get_args() is not args:
        raise StartupError("Megatron's global args are not the ones it parsed; re-verify")
    step.check(args)
    return install.install(args)


def _model_provider(step: Step, args: Any) -> Callable[..., Any]:
    """0.17/0.18: the script's model provider, or the overlay's own GPT one (checked)."""
    if step.model_provider is not None:
        return step.model_provider
    gpt_model.check_supported(args)
    return gpt_model.model_provider


def run_with_config_container(step: Step, broadcast: Broadcast) -> None:
    """megatron-core 0.19: ``pretrain(cfg_container, ...)`` with the GPT model config, or
    without one and with the script's model provider."""
    from megatron.training.argument_utils import (
        gpt_config_from_args,
        pretrain_cfg_container_from_args,
    )

    args, run, store = _parse_and_wrap(step)
    features = _install(step, args)
    if step.model_provider is None:
        config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
        install.attach(config, features)
        own_model = {}
    else:
        config = pretrain_cfg_container_from_args(args)
        own_model = {"model_provider": partial(step.model_provider, features)}
    forward_step, datasets_provider = step.bind(features, broadcast)
    run(
        config,
        datasets_provider,
        step.model_type,
        forward_step,
        store=store,
        get_embedding_ranks=step.get_embedding_ranks,
        **own_model,
    )


def run_with_model_provider(step: Step, broadcast: Broadcast) -> None:
    """megatron-core 0.18: ``pretrain(cfg_container, ..., model_provider, ...)``."""
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    args, run, store = _parse_and_wrap(step)
    model_provider = _model_provider(step, args)
    features = _install(step, args)
    forward_step, datasets_provider = step.bind(features, broadcast)
    run(
        pretrain_cfg_container_from_args(args),
        datasets_provider,
        partial(model_provider, features),
        step.model_type,
        forward_step,
        store=store,
        get_embedding_ranks=step.get_embedding_ranks,
    )


@dataclass
class ClassicInit:
    """What ``classic-pretrain-parsed-args`` is applied with: the args parsed once, and the
    features (and the script's functions bound to them) once ``initialize_megatron`` made
    them Megatron's."""

    args: Any
    step: Step
    broadcast: Broadcast
    ready: tuple[FeatureSet, tuple[Callable[..., Any], Any], Callable[..., Any]] | None = None

    def initialized(self) -> None:
        model_provider = _model_provider(self.step, self.args)
        features = _install(self.step, self.args)
        self.ready = features, self.step.bind(features, self.broadcast), model_provider

    def get(self) -> tuple[FeatureSet, tuple[Callable[..., Any], Any], Callable[..., Any]]:
        """The features, the script's (forward step, dataset provider) and model provider."""
        if self.ready is None:
            raise StartupError("pretrain called a step before initialize_megatron; re-verify")
        return self.ready


def run_classic(step: Step, broadcast: Broadcast) -> None:
    """megatron-core 0.17: classic ``pretrain(dataset_provider, model_provider, ...)``."""
    from megatron.training import inprocess_restart, pretrain
    from megatron.training.arguments import parse_args

    args_provider = partial(_args_provider, step)
    late = ClassicInit(parse_args(args_provider), step, broadcast)
    registry.CLASSIC_INIT.apply(late)
    run, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)

    def forward_step(data_iterator: Any, model: Any) -> Any:
        _, (bound_step, _), _ = late.get()
        return bound_step(data_iterator, model)

    def datasets_provider(train_val_test_num_samples: list[int], vp_stage: int | None = None):
        _, (_, bound_provider), _ = late.get()
        return bound_provider(train_val_test_num_samples, vp_stage)

    def model_provider(*args: Any, **kwargs: Any) -> Any:
        features, _, provider = late.get()
        return provider(features, *args, **kwargs)

    datasets_provider.is_distributed = True  # type: ignore[attr-defined]  # every rank calls it
    run(
        datasets_provider,
        model_provider,
        step.model_type,
        forward_step,
        extra_args_provider=args_provider,
        args_defaults=step.args_defaults,
        store=store,
        get_embedding_ranks=step.get_embedding_ranks,
    )


# The code of each form of the registry's entries, by the versions the form was verified on.
RUNNERS = {V19: run_with_config_container, V18: run_with_model_provider, V17: run_classic}
BROADCASTS = {
    V19: gpt_step.broadcast_batch,
    V18: gpt_step.broadcast_batch_is_sft,
    V17: gpt_step.broadcast_batch_from_iterator,
}


def for_installed(forms: dict[tuple[str, ...], Callable[..., Any]], entry: str) -> Any:
    """The code of the registry entry ``entry``'s form for the installed megatron-core."""
    return forms[registry.assumption(entry).selected().verified_on]


def run(step: Step | None = None) -> None:
    """Train with ``step`` (None: the overlay's GPT step) through the installed version's form."""
    runner = for_installed(RUNNERS, "entry-point")
    runner(
        overlay_step() if step is None else step, for_installed(BROADCASTS, "batch-on-this-rank")
    )
