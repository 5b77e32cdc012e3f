"""The Megatron-style args the features are installed on (Bridge has none): Megatron's parser
on the megatron-ext flags, then the fields the features read from the ``ConfigContainer``. What
cannot work under Bridge is refused here, before anything starts (:class:`BridgeRefusal`).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from megatron_ext.common.bridge_state import data_path_words, parse_megatron_args
from megatron_ext.common.errors import StartupError

# Megatron's flags the launchers give any script (the skip list resolved): the integration
# sets the config from the first three (megatron_ext.bridge.run.apply_launcher_flags).
LAUNCHER_ARGS = frozenset(
    {
        "save",
        "load",
        "exit_signal_handler",
        "iterations_to_skip",
        "result_rejected_tracker_filename",
    }
)


class BridgeRefusal(StartupError):
    """The Bridge configuration asks for something the integration cannot support."""


def refuse_unsupported(config: Any) -> None:
    """The ConfigContainer settings the features cannot run under, each with why."""
    restart = getattr(config, "inprocess_restart", None)
    if restart is not None and getattr(restart, "enabled", False):
        raise BridgeRefusal(
            "inprocess_restart.enabled: Bridge's in-process restart catches the spike "
            "detector's exit (SystemExit with the rollback code) and restarts the loop in the "
            "same process from the same checkpoint, so the rollback never reaches the "
            "supervisor and the bad window is replayed. Disable it; megatron-ext's supervisor "
            "relaunches the job (launch/run_single_node.sh)"
        )
    if getattr(config.checkpoint, "async_save", False):
        raise BridgeRefusal(
            "checkpoint.async_save: the save veto and the rollback's train-state rewrite are "
            "verified with synchronous saves only"
        )
    if getattr(config.checkpoint, "custom_manager_class", None) is not None:
        raise BridgeRefusal(
            "checkpoint.custom_manager_class is set: megatron-ext puts its own manager there "
            "(the spike detector's save veto); combine the two by hand or drop yours"
        )
    if getattr(config.ddp, "use_megatron_fsdp", False) or getattr(
        config.dist, "use_megatron_fsdp", False
    ):
        raise BridgeRefusal(
            "Megatron-FSDP: the features are not verified under it (telemetry needs Megatron's "
            "ChainedOptimizer and DDP buckets)"
        )
    refuse_pipeline_p2p(config)


def refuse_pipeline_p2p(config: Any) -> None:
    """A virtual pipeline over 2 stages without overlapped P2P (the model config's default,
    which a ``comm_overlap`` config turns on): Megatron's validate_args refuses it, Bridge does
    not, and the interleaved schedule then trains silently wrong."""
    model, overlap = config.model, getattr(config, "comm_overlap", None)
    overlapped = model.overlap_p2p_comm
    if overlap is not None:  # its setup turns it on for a virtual pipeline, unless told not to
        overlapped = True if overlap.overlap_p2p_comm is None else overlap.overlap_p2p_comm
    if (
        (model.virtual_pipeline_model_parallel_size or 1) > 1
        and model.pipeline_model_parallel_size <= 2
        and not overlapped
    ):
        raise BridgeRefusal(
            "a virtual pipeline over 2 stages with model.overlap_p2p_comm=False: the "
            "interleaved schedule's batched sends and receives between the same 2 ranks do "
            "not pair up (Megatron's validate_args refuses it; under Bridge it trains wrong "
            "gradients). Set model.overlap_p2p_comm=True and model.batch_p2p_comm=False, as "
            "Bridge's CommOverlapConfig does for a virtual pipeline"
        )


def megatron_args(config: Any, flags: list[str]) -> Any:
    """Megatron's parser (with the overlay's group) on ``flags``, then the ConfigContainer's
    fields the features read; also Megatron's global args (``calc_params_l2_norm`` reads them)."""
    from megatron.training import global_vars

    from megatron_ext.loop.install import add_megatron_ext_args

    args = parse_megatron_args(flags, add_megatron_ext_args)
    # Not the cached megatron_defaults(): rank and world size come from this moment's env.
    refuse_megatron_flags(args, parse_megatron_args([]))
    if args.fused_output_loss and getattr(config.dataset, "eod_mask_loss", False):
        raise BridgeRefusal(
            "--fused-output-loss with dataset.eod_mask_loss=True: Bridge's GPT step does not "
            "pass the loss mask to the model, so the fused output layer's weight gradient "
            "would count the masked tokens. Set eod_mask_loss=False or drop the flag"
        )
    for name, value in config_values(config, args).items():
        setattr(args, name, value)
    global_vars.set_args(args)
    return args


def refuse_megatron_flags(args: Any, defaults: Any) -> None:
    """Megatron's own flags set in ``args``: Bridge trains what the ConfigContainer says, so
    they would be accepted and ignored (the launchers' own, LAUNCHER_ARGS, excepted)."""
    from megatron_ext.loop.install import add_megatron_ext_args

    ours = {*vars(add_megatron_ext_args(argparse.ArgumentParser()).parse_args([])), *LAUNCHER_ARGS}
    given = [
        "--" + name.replace("_", "-")
        for name, value in vars(args).items()
        if name not in ours and value != getattr(defaults, name, value)
    ]
    if given:
        raise BridgeRefusal(
            f"{', '.join(given)}: Megatron's own flags, which Bridge does not read (it trains "
            "what the ConfigContainer says, e.g. config.train.micro_batch_size); set them in "
            "the config instead. The flags list holds megatron-ext's flags (docs/bridge.md)"
        )


def config_values(config: Any, args: Any) -> dict[str, Any]:
    """The Megatron args fields the features read, from the ConfigContainer and the launch."""
    model, train, ckpt, dataset = config.model, config.train, config.checkpoint, config.dataset
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp, pp = model.tensor_model_parallel_size, model.pipeline_model_parallel_size
    cp, mock = getattr(model, "context_parallel_size", 1) or 1, _mock(dataset)
    return {
        "rank": int(os.environ.get("RANK", "0")),
        "world_size": world,
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "context_parallel_size": cp,
        "virtual_pipeline_model_parallel_size": model.virtual_pipeline_model_parallel_size,
        "sequence_parallel": model.sequence_parallel,
        "num_experts": model.num_moe_experts,
        "data_parallel_size": world // (tp * pp * cp),
        "micro_batch_size": train.micro_batch_size,
        "global_batch_size": train.global_batch_size,
        "train_iters": train.train_iters,
        # The skip lists the start-up resolved (flags, file, persisted), and the config's own.
        "iterations_to_skip": sorted(
            {*(args.iterations_to_skip or ()), *(train.iterations_to_skip or ())}
        ),
        "seq_length": model.seq_length,
        "vocab_size": getattr(config.tokenizer, "vocab_size", None),
        "untie_embeddings_and_output_weights": not model.share_embeddings_and_output_weights,
        "cross_entropy_loss_fusion": model.cross_entropy_loss_fusion,
        "cross_entropy_fusion_impl": getattr(model, "cross_entropy_fusion_impl", "native"),
        "overlap_grad_reduce": config.ddp.overlap_grad_reduce,
        "overlap_param_gather": config.ddp.overlap_param_gather,
        "use_distributed_optimizer": config.ddp.use_distributed_optimizer,
        "transformer_impl": "local",
        "save": ckpt.save,
        "load": ckpt.load,
        "save_interval": ckpt.save_interval,
        "async_save": ckpt.async_save,
        "finetune": bool(getattr(ckpt, "finetune", False)),
        "no_load_optim": bool(getattr(ckpt, "load_optim", True) is False),
        "data_path": data_path_words(
            getattr(dataset, "data_path", None), getattr(dataset, "blend", None)
        ),
        # megatron-core's mock data splits 1,1,1 whatever the config says (what Bridge saves).
        "split": "1,1,1" if mock else getattr(dataset, "split", None),
        "data_cache_path": getattr(dataset, "path_to_cache", None),
        "dataloader_type": getattr(dataset, "dataloader_type", None),
        "mock_data": mock,
        "seed": config.rng.seed,
        "log_interval": config.logger.log_interval,
        "iteration": 0,
        "curr_iteration": 0,
        "consumed_train_samples": 0,
        "skipped_train_samples": 0,
    }


def _mock(dataset: Any) -> bool:
    """Mock data: what megatron-core's dataset config decides at Bridge's ``finalize``
    (no ``blend``, ``blend_per_split`` nor ``data_path``), before it runs."""
    if getattr(dataset, "mock", False):
        return True
    per_split = getattr(dataset, "blend_per_split", None)
    given = (getattr(dataset, "blend", None), getattr(dataset, "data_path", None))
    return hasattr(dataset, "blend") and not any(given) and not (per_split and any(per_split))
