"""megatron-ext: an overlay on Megatron Core (supported versions:
:mod:`megatron_ext.common.versions`).

One folder per feature, each with a core (no Megatron import) and an adapter (the feature's
flags and hooks, :mod:`megatron_ext.common.features`); every touch of Megatron internals is declared
in :mod:`megatron_ext.registry.table`.
"""

__version__ = "0.1.0"
