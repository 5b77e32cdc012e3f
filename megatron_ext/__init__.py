"""megatron-ext: an overlay on Megatron Core (pinned, see ``MEGATRON_CORE_VERSION``).

One folder per feature, each with a core (no Megatron import) and an adapter (the feature's
flags and hooks, :mod:`megatron_ext.features`); every touch of Megatron internals is declared
in :mod:`megatron_ext.registry`.
"""

__version__ = "0.1.0"

MEGATRON_CORE_VERSION = "0.19.2"
