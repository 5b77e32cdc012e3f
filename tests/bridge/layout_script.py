"""docs/examples/pretrain_bridge.py at a model-parallel layout: ``--tp N --pp N --vpp N --cp N
--layers N`` set the example's model provider (``--te``: Transformer Engine's layer spec, which
CP needs; GPU only), ``--eval-iters N --split S`` an evaluation after the last iteration (and in
the loop at it), the rest goes to the example (``--plain``: Bridge alone). What
tests/bridge/test_bridge_layouts.py launches."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "pretrain_bridge.py"


def _example():
    spec = importlib.util.spec_from_file_location("pretrain_bridge", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    for flag, default in (("--tp", 1), ("--pp", 1), ("--vpp", 0), ("--cp", 1), ("--layers", 2)):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--te", action="store_true")
    parser.add_argument("--eval-iters", type=int, default=0)
    parser.add_argument("--split")
    layout, rest = parser.parse_known_args(argv)
    example = _example()
    options, ext_flags = example.parse(rest)
    config = example.config(options)
    if layout.eval_iters:
        config.validation.eval_iters = layout.eval_iters
        config.validation.eval_interval = options.train_iters
        config.dataset.split = layout.split
    model = config.model
    model.tensor_model_parallel_size = layout.tp
    model.pipeline_model_parallel_size = layout.pp
    model.virtual_pipeline_model_parallel_size = layout.vpp or None
    model.context_parallel_size = layout.cp
    if layout.te:
        from megatron.bridge.models.gpt_provider import transformer_engine_layer_spec

        model.transformer_layer_spec = transformer_engine_layer_spec
    model.num_layers = layout.layers
    if layout.vpp:  # what megatron_ext.bridge.args.refuse_pipeline_p2p asks for
        model.overlap_p2p_comm, model.batch_p2p_comm = True, False
    model.pipeline_dtype = torch.float32
    if options.plain:
        from megatron.bridge.training.gpt_step import forward_step
        from megatron.bridge.training.pretrain import pretrain

        pretrain(config, forward_step)
        return
    from megatron_ext.bridge import pretrain

    pretrain(config, ext_flags)


if __name__ == "__main__":
    main(sys.argv[1:])
