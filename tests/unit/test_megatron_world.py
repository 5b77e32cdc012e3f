"""The in-process world of the adapter tests (tests/support/megatron_world.py) leaves nothing
behind: no process group, no parallel state, torch.cuda and the torch function modes as they
were, and no registry patch a feature's install applied."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ext.loop import install as loop
from megatron_ext.registry import table as registry
from megatron_ext.zloss.adapter import ZLossFeature
from tests.support import megatron_world as mw


def test_the_world_is_undone_on_exit() -> None:
    from megatron.core import parallel_state

    current_device, rng = torch.cuda.current_device, torch.get_rng_state()
    with mw.megatron_world(), mw.patches_undone():
        assert dist.get_world_size() == 1 and parallel_state.model_parallel_is_initialized()
        assert torch.zeros(1, device="cuda").device.type == "cpu"
        feature = ZLossFeature()
        feature.install(mw.args(z_loss_coeff=1e-4, **mw.PLAIN_OUTPUT_LOSS))
        loop.apply_patches_of(feature)
        assert registry.patch("zloss-output-layer").is_applied()
        mw.tiny_gpt()
    assert not dist.is_initialized() and not parallel_state.model_parallel_is_initialized()
    assert torch.cuda.current_device is current_device
    assert torch._C._len_torch_function_stack() == 0
    assert torch.equal(torch.get_rng_state(), rng)
    assert not registry.patch("zloss-output-layer").is_applied()
