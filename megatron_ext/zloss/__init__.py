"""Output-layer z-loss (PaLM, OLMo 2/3): ``CE + c·log²Z`` in one vocab-parallel pass.

``core`` holds the kernels (no Megatron import); ``adapter`` the ``--z-loss-coeff`` feature.
"""

from megatron_ext.zloss.core import (
    ZLossTerms,
    cross_entropy_and_z_loss,
    vocab_parallel_cross_entropy_with_z_loss,
)

__all__ = ["ZLossTerms", "cross_entropy_and_z_loss", "vocab_parallel_cross_entropy_with_z_loss"]
