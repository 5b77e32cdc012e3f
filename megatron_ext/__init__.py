"""megatron-ext: an overlay on Megatron Core (pinned, see ``MEGATRON_CORE_VERSION``).

Feature cores are plain modules without Megatron imports; their Megatron adapters sit next
to them, and every runtime change to Megatron goes through :mod:`megatron_ext.patches`.
"""

__version__ = "0.1.0"

MEGATRON_CORE_VERSION = "0.19.2"
