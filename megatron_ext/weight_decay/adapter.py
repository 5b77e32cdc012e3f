"""The weight-decay feature in Megatron: the multipliers of :mod:`.core` (docs/weight-decay.md)
as one ``wd_mult`` ``ParamKey`` per multiplier, the start-up map, and the resume check (run for
every run, flags or not, so dropping them on a resume is caught too).
"""

from __future__ import annotations

import argparse
import inspect
import os
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from megatron_ext.common.features import Feature, FeatureError, print_rank_0
from megatron_ext.weight_decay.core import (
    EMBEDDING_FLAG,
    OUTPUT_LAYER_FLAG,
    OVERRIDE_FLAG,
    WEIGHT_DECAY_ARGS,
    GlobUsage,
    WeightDecayConfigError,
    WeightDecayPolicy,
    check_mult,
    check_resume,
    parse_override,
    policy_from_values,
    strip_wrappers,
)

_KEY_PREFIX = "megatron-ext:wd_mult="


def _mult_arg(text: str) -> float:
    try:
        return check_mult(float(text), "weight-decay multiplier")
    except ValueError as exc:  # WeightDecayConfigError included
        raise argparse.ArgumentTypeError(str(exc)) from None


def _override_arg(text: str) -> str:
    """Validate at parse time but keep the string: args are pickled into checkpoints."""
    try:
        parse_override(text)
    except WeightDecayConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


class WeightDecayFeature(Feature):
    """Per-parameter weight-decay multipliers, and the resume check that guards them."""

    name = "weight_decay"

    def __init__(self) -> None:
        self.policy: WeightDecayPolicy | None = None

    def add_args(self, group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            EMBEDDING_FLAG,
            type=_mult_arg,
            default=None,
            metavar="MULT",
            help="Weight-decay multiplier for the input embedding (OLMo 2: 0). With tied "
            "embeddings it also covers the output layer. 1-D params and biases stay at 0.",
        )
        group.add_argument(
            OUTPUT_LAYER_FLAG,
            type=_mult_arg,
            default=None,
            metavar="MULT",
            help="Weight-decay multiplier for the untied output layer (ignored, with a warning, "
            "when embeddings are tied).",
        )
        group.add_argument(
            OVERRIDE_FLAG,
            type=_override_arg,
            action="append",
            default=None,
            metavar="GLOB=MULT",
            help="Weight-decay multiplier for parameters whose name matches GLOB (fnmatch, names "
            "without 'module.' prefixes, as printed at start-up). Repeatable; the last matching "
            "one wins and beats the embedding/output-layer flags; Megatron's 1-D/bias exemption "
            "always wins. Resuming with different multipliers is refused.",
        )

    def enabled(self, args: Any) -> bool:
        """Always: a resume that drops the flags must be caught too."""
        return True

    def validate(self, args: Any) -> None:
        """Refuse a resume under other multipliers (:class:`WeightDecayResumeError`)."""
        check_resume_compatible(args, policy_from_args(args))

    def install(self, args: Any) -> None:
        """Warn about ineffective settings (the patches follow when a flag is set)."""
        self.policy = policy_from_args(args)
        for warning in self.policy.warnings():
            print_rank_0(f"megatron-ext: WARNING: {warning}")

    def needs_patch(self, name: str) -> bool:
        return self.policy is not None and self.policy.active

    def on_model_built(self, model: list[Any]) -> None:
        """Refuse GLOBs that match no parameter of any stage, before DDP and the optimizer."""
        policy = self.policy
        assert policy is not None, "on_model_built before install"
        if not policy.overrides:
            return
        usage = GlobUsage.empty(policy)
        names = []
        for chunk in model:
            for name, param in chunk.named_parameters():
                if param.requires_grad:
                    usage.count(policy, name, decided_by_flags=False)
                    names.append(strip_wrappers(name))
        gathered: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, usage.matched)
        matched = [sum(counts) for counts in zip(*gathered)]
        unmatched = [str(o) for o, n in zip(policy.overrides, matched) if not n]
        if unmatched:
            shown = ", ".join(names[:4] + (["..."] if len(names) > 4 else []))
            raise FeatureError(
                f"{OVERRIDE_FLAG} {', '.join(repr(u) for u in unmatched)} matches no parameter of "
                f"the model (names are fnmatch'ed without 'module.' prefixes, layer indices "
                f"local to a pipeline stage; this stage has {shown}). Fix the GLOB; nothing was "
                "wrapped or trained"
            )


def policy_from_args(args: Any) -> WeightDecayPolicy:
    """The policy of a Megatron args namespace (a checkpoint's saved args included)."""
    return policy_from_values(
        *(getattr(args, name, None) for name in WEIGHT_DECAY_ARGS),
        tied=not getattr(args, "untie_embeddings_and_output_weights", False),
    )


def check_resume_compatible(args: Any, policy: WeightDecayPolicy) -> None:
    """Compare with the flags saved in the checkpoint this run will load its optimizer from
    (Megatron's args, or under Bridge the overlay's layout file)."""
    if args.load is None or args.no_load_optim or args.finetune:
        return
    from megatron_ext.common import bridge_state

    bridge = bridge_state.saved_overlay_args(args.load)
    if bridge is not None:  # Megatron-Bridge's checkpoint: the flags in the overlay's file
        directory, saved = bridge
        check_resume(policy_from_args(argparse.Namespace(**saved)), policy, str(directory))
        return
    from megatron.training.checkpointing import (
        _load_base_checkpoint,
        get_checkpoint_tracker_filename,
    )

    # Without a tracker file there is nothing to resume (and Megatron's own message follows).
    if not os.path.isfile(get_checkpoint_tracker_filename(args.load)):
        return
    state_dict, checkpoint, _, _ = _load_base_checkpoint(args.load, args, rank0=True)
    if state_dict and "args" in state_dict:
        check_resume(policy_from_args(state_dict["args"]), policy, checkpoint)


def _decides(
    policy: WeightDecayPolicy,
    megatron_wd_keys: list[Any],
    mult: float,
    param: torch.nn.Parameter,
    name: str,
) -> bool:
    """Whether ``mult`` is this parameter's multiplier; never where a Megatron key sets
    ``wd_mult`` (Megatron's rule wins; two values would be a merge conflict)."""
    if any(key.matches(param, name) for key in megatron_wd_keys):
        return False
    return policy.resolve(name).mult == mult


def extend_overrides(config_overrides: dict, policy: WeightDecayPolicy) -> dict:
    """Megatron's overrides plus one ``wd_mult`` key per multiplier other than 1.0 (the
    default; an explicit 1.0 group would duplicate Megatron's group identifier)."""
    from megatron.core.optimizer import ParamKey, ParamWithNamePredicate

    megatron_wd_keys = [key for key, value in config_overrides.items() if "wd_mult" in value]
    extended = dict(config_overrides)
    for mult in sorted(policy.multipliers() - {1.0}):
        predicate = ParamWithNamePredicate(
            name=f"{_KEY_PREFIX}{mult!r}", fn=partial(_decides, policy, megatron_wd_keys, mult)
        )
        extended[ParamKey(with_name_predicate=predicate)] = {"wd_mult": mult}
    return extended


def with_overrides(
    original: Callable[[Any], Any], feature: WeightDecayFeature
) -> Callable[[Any], Any]:
    """Wrapper of the ``weight-decay-overrides`` patch, bound to the installed feature."""
    policy = feature.policy
    assert policy is not None, "weight-decay-overrides applied before the feature's install"

    def get_megatron_optimizer_config(args: Any) -> Any:
        """Megatron's optimizer config and overrides, plus the megatron-ext multipliers."""
        config, config_overrides = original(args)
        return config, extend_overrides(config_overrides, policy)

    return get_megatron_optimizer_config


def _param_entries(
    model_chunks: list[Any], config_overrides: dict, policy: WeightDecayPolicy, usage: GlobUsage
) -> list[tuple[int, str, float, str, str]]:
    """(chunk, name, wd_mult, decided by, other overrides) of this rank's parameters, with
    the keys and merge Megatron's ``_get_param_groups`` uses."""
    from megatron.core.optimizer_param_scheduler import combine_param_group_overrides

    entries = []
    for chunk_index, chunk in enumerate(model_chunks):
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            matching = [
                (key, value) for key, value in config_overrides.items() if key.matches(param, name)
            ]
            combined = combine_param_group_overrides([value for _, value in matching])
            by_megatron = any("wd_mult" in value and not _is_ours(key) for key, value in matching)
            usage.count(policy, name, decided_by_flags=not by_megatron)
            source = (
                "Megatron: no decay for 1-D params and biases"
                if by_megatron
                else policy.resolve(name).source
            )
            others = ", ".join(f"{k}={v}" for k, v in sorted(combined.items()) if k != "wd_mult")
            entries.append(
                (chunk_index, strip_wrappers(name), combined.get("wd_mult", 1.0), source, others)
            )
    return entries


def _is_ours(key: Any) -> bool:
    """Whether a ParamKey is one :func:`extend_overrides` added."""
    return getattr(key.with_name_predicate, "name", "").startswith(_KEY_PREFIX)


def report_param_groups(
    model_chunks: list[Any], config_overrides: dict, weight_decay: float, policy: WeightDecayPolicy
) -> None:
    """Print every stage's parameter → multiplier map on rank 0; raise on unmatched GLOBs.
    One rank per stage contributes to one all_gather_object, so every rank reaches the same
    verdict."""
    from megatron.core import parallel_state as mpu

    payload = None
    if (
        mpu.get_tensor_model_parallel_rank() == 0
        and mpu.get_data_parallel_rank(with_context_parallel=True) == 0
    ):
        usage = GlobUsage.empty(policy)
        entries = _param_entries(model_chunks, config_overrides, policy, usage)
        payload = (mpu.get_pipeline_model_parallel_rank(), usage, entries)
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, payload)

    total = GlobUsage.empty(policy)
    lines = [
        f"megatron-ext weight decay per parameter = --weight-decay {weight_decay:g} "
        f"x wd_mult; flags: {policy.describe()}"
    ]
    for stage, usage, entries in filter(None, gathered):
        total.add(usage)
        chunks = len({chunk for chunk, *_ in entries})
        for chunk, name, mult, source, others in entries:
            where = f"pp{stage}" + (f".vp{chunk}" if chunks > 1 else "")
            extra = f" [{others}]" if others else ""
            lines.append(f"  {where} {name} wd_mult={mult:g}{extra} <- {source}")
    errors, warnings = total.problems(policy)
    lines += [f"megatron-ext: WARNING: {warning}" for warning in warnings]
    print_rank_0("\n".join(lines))
    if errors:
        raise WeightDecayConfigError("megatron-ext: " + "; ".join(errors))


def with_param_map(original: Callable[..., Any], feature: WeightDecayFeature) -> Callable[..., Any]:
    """Wrapper of the ``weight-decay-map`` patch, bound to the installed feature."""
    signature = inspect.signature(original)
    policy = feature.policy
    assert policy is not None, "weight-decay-map applied before the feature's install"

    def get_megatron_optimizer(*args: Any, **kwargs: Any) -> Any:
        """Megatron's optimizer, then the start-up map of the multipliers it was built with."""
        optimizer = original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs).arguments
        report_param_groups(
            bound["model_chunks"],
            bound.get("config_overrides") or {},
            bound["config"].weight_decay,
            policy,
        )
        return optimizer

    return get_megatron_optimizer
