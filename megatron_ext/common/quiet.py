"""Keep the import chatter of optional dependencies (Transformer Engine, Apex, absl, CUDA) out
of CLI commands' output. Never called on a training path: training logs keep the warnings,
which say what a run falls back to.
"""

from __future__ import annotations

import logging
import warnings

# Each pattern: an optional dependency (or a single-process tool run) announced at import.
IMPORT_NOISE = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"absl\.logging is not installed",
    r"Only transformer-engine>=",
    # Megatron's rank helpers and torch's checkpoint reader, outside a process group.
    r"Could not determine rank from torch\.distributed",
    r"torch\.distributed is disabled, unavailable or uninitialized",
)
# torch logs "No CUDA runtime is found, using CUDA_HOME=..." at WARNING on CUDA-less hosts.
NOISY_LOGGERS = ("torch.utils.cpp_extension",)


def silence_import_noise() -> None:
    """Install the filters; call before anything imports torch or Megatron."""
    for pattern in IMPORT_NOISE:
        warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
