"""megatron-ext for Megatron-Bridge users: every feature in one call (docs/bridge.md).

A Bridge script keeps its ``ConfigContainer``; one line replaces Bridge's ``pretrain``::

    from megatron_ext.bridge import pretrain

    pretrain(config, ["--z-loss-coeff", "1e-4", "--spike-detect", "--signals-dir", RUN,
                      "--sample-log-dir", SAMPLES, ...])

:func:`pretrain` installs the features on Megatron-style args made from the config
(:mod:`megatron_ext.bridge.args`), wires each hook to Bridge's public mechanism
(:mod:`megatron_ext.bridge.wiring`, :mod:`megatron_ext.bridge.checkpoints`) or to a registry
entry verified on the installed Bridge (:mod:`megatron_ext.bridge.table`), and calls Bridge's
own ``pretrain``. Nothing here imports Bridge until it is called.
"""

from megatron_ext.bridge.run import pretrain

__all__ = ["pretrain"]
