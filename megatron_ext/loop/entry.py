"""How a training script drives each megatron-core's ``pretrain`` (registry
``entry-point``: one runner per variant, picked for the installed version). The script's part
is a :class:`~megatron_ext.loop.step.Step`: the overlay's GPT step (:func:`overlay_step`, for
``pretrain_gpt_ext.py``) or a script of the user's own (:mod:`megatron_ext.fork`).

- 0.19: :func:`run_with_config_container`: the GPT model config and the config container
  from the parsed args; Megatron builds the model and calls ``pre_wrap_hooks``. A script with
  its own model provider gets a container without a model config and ``pretrain`` its
  provider (registry ``script-model-provider``).
- 0.18: :func:`run_with_model_provider`: the config container has no model config, so
  ``pretrain`` gets the script's model provider, or the overlay's own
  (:mod:`megatron_ext.loop.gpt_model`).
- 0.17: :func:`run_classic`: classic ``pretrain`` parses the arguments again inside
  ``initialize_megatron``; features kept the first parse's object, which Megatron never filled
  (every signals row had ``consumed_samples = 0``). The arguments are parsed once here,
  handed to ``initialize_megatron`` (registry ``classic-pretrain-parsed-args``), validated
  there, and the features are installed on exactly that object once it is Megatron's
  global args.

Every runner checks that the features' args are Megatron's global args before installing.
The loop's functions come in a :class:`Wiring` from the entry point (the registry names these
runners, and the loop applies the registry's patches: importing the loop here would close a
cycle).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from megatron_ext.common.errors import StartupError
from megatron_ext.common.features import FeatureSet
from megatron_ext.loop import gpt_model, gpt_step
from megatron_ext.loop.step import Step
from megatron_ext.registry.patching import Patch

ARGS_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}


def overlay_step() -> Step:
    """``pretrain_gpt_ext.py``'s part: the overlay's GPT step, dataset provider and model
    (:mod:`megatron_ext.loop.gpt_step`, :mod:`megatron_ext.loop.gpt_model`)."""
    from megatron.core.enums import ModelType

    return Step(
        bind=gpt_step.bind,
        check=gpt_step.check_supported,
        model_type=ModelType.encoder_or_decoder,
        get_embedding_ranks=gpt_step.get_embedding_ranks,
        args_defaults=ARGS_DEFAULTS,
    )


@dataclass(frozen=True)
class Wiring:
    """What every runner is handed: the installed version's batch broadcast (registry
    ``batch-on-this-rank``), the classic-args patch, the loop's functions
    (:func:`megatron_ext.loop.install.add_megatron_ext_args`, ``install``, ``attach``) and the
    script's :class:`Step`."""

    broadcast: Callable[..., dict[str, Any]]
    classic_init: Patch
    add_args: Callable[[Any], Any]
    install: Callable[[Any], FeatureSet]
    attach: Callable[[Any, FeatureSet], None]
    step: Step

    def args_provider(self, parser: Any) -> Any:
        """Megatron's ``extra_args_provider``: the script's flags, then the overlay's group."""
        if self.step.extra_args_provider is not None:
            parser = self.step.extra_args_provider(parser)
        return self.add_args(parser)


def _parse_and_validate(wiring: Wiring) -> Any:
    from megatron.training.arguments import parse_and_validate_args

    # Parse before Megatron's in-process-restart wrapper: it parses sys.argv without the
    # megatron-ext group, so `--help` would print (and exit) without the overlay's flags.
    return parse_and_validate_args(
        extra_args_provider=wiring.args_provider, args_defaults=wiring.step.args_defaults
    )


def _install(wiring: Wiring, args: Any) -> FeatureSet:
    """The features, installed on ``args`` once they are Megatron's global args (Megatron
    fills them as it goes: resume iteration, consumed samples, padded vocab)."""
    from megatron.training import get_args

    if get_args() is not args:
        raise StartupError("Megatron's global args are not the ones it parsed; re-verify")
    wiring.step.check(args)
    return wiring.install(args)


def _model_provider(step: Step, args: Any) -> Callable[..., Any]:
    """0.17/0.18: the script's model provider, or the overlay's own GPT one (checked)."""
    if step.model_provider is not None:
        return step.model_provider
    gpt_model.check_supported(args)
    return gpt_model.model_provider


def run_with_config_container(wiring: Wiring) -> None:
    """megatron-core 0.19: ``pretrain(cfg_container, ...)`` with the GPT model config, or
    without one and with the script's model provider."""
    from megatron.training import inprocess_restart, pretrain
    from megatron.training.argument_utils import (
        gpt_config_from_args,
        pretrain_cfg_container_from_args,
    )

    step = wiring.step
    args = _parse_and_validate(wiring)
    run, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    features = _install(wiring, args)
    if step.model_provider is None:
        config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
        wiring.attach(config, features)
        own_model = {}
    else:
        config = pretrain_cfg_container_from_args(args)
        own_model = {"model_provider": partial(step.model_provider, features)}
    forward_step, datasets_provider = step.bind(features, wiring.broadcast)
    run(
        config,
        datasets_provider,
        step.model_type,
        forward_step,
        store=store,
        get_embedding_ranks=step.get_embedding_ranks,
        **own_model,
    )


def run_with_model_provider(wiring: Wiring) -> None:
    """megatron-core 0.18: ``pretrain(cfg_container, ..., model_provider, ...)``."""
    from megatron.training import inprocess_restart, pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    step = wiring.step
    args = _parse_and_validate(wiring)
    run, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    model_provider = _model_provider(step, args)
    features = _install(wiring, args)
    forward_step, datasets_provider = step.bind(features, wiring.broadcast)
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
    features installed on them (and the script's functions bound to them) once
    ``initialize_megatron`` validated them."""

    args: Any
    wiring: Wiring
    features: FeatureSet | None = field(default=None)
    bound: tuple[Callable[..., Any], Any] | None = field(default=None)
    model_provider: Callable[..., Any] | None = field(default=None)

    def initialized(self) -> None:
        self.model_provider = _model_provider(self.wiring.step, self.args)
        self.features = _install(self.wiring, self.args)
        self.bound = self.wiring.step.bind(self.features, self.wiring.broadcast)

    def get(self) -> tuple[FeatureSet, tuple[Callable[..., Any], Any], Callable[..., Any]]:
        """The features, the script's (forward step, dataset provider) and model provider."""
        if self.features is None or self.bound is None or self.model_provider is None:
            raise StartupError("pretrain called a step before initialize_megatron; re-verify")
        return self.features, self.bound, self.model_provider


def with_parsed_args(original: Callable[..., Any], bound: ClassicInit) -> Callable[..., Any]:
    """Classic ``initialize_megatron`` on the entry point's parsed args (it validates them and
    makes them the global args), then the features installed on them."""

    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        kwargs["parsed_args"] = bound.args
        result = original(*args, **kwargs)
        bound.initialized()
        return result

    return initialize_megatron


def run_classic(wiring: Wiring) -> None:
    """megatron-core 0.17: classic ``pretrain(dataset_provider, model_provider, ...)``."""
    from megatron.training import inprocess_restart, pretrain
    from megatron.training.arguments import parse_args

    step = wiring.step
    late = ClassicInit(parse_args(wiring.args_provider), wiring)
    wiring.classic_init.apply(late)
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
        extra_args_provider=wiring.args_provider,
        args_defaults=step.args_defaults,
        store=store,
        get_embedding_ranks=step.get_embedding_ranks,
    )
