"""megatron-ext for Megatron-Bridge users: every feature in one call (docs/bridge.md)::

    from megatron_ext.bridge import pretrain

    pretrain(config, ["--z-loss-coeff", "1e-4", "--spike-detect", ...])

Nothing here imports Bridge until it is called.
"""

from megatron_ext.bridge.run import pretrain

__all__ = ["pretrain"]
