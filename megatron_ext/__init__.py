"""megatron-ext: an overlay on Megatron Core (supported versions:
:mod:`megatron_ext.common.versions`). Features have a core (no Megatron import) and an adapter
(:mod:`megatron_ext.common.features`); every touch of Megatron internals is declared in
:mod:`megatron_ext.registry.table`.
"""

__version__ = "0.1.0"
