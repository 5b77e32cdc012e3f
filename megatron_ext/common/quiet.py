"""Keep the import chatter of optional dependencies out of CLI commands' output.

Importing Megatron on a machine without Transformer Engine, Apex, absl or CUDA prints about ten
warnings ("Transformer Engine and Apex are not installed", "No CUDA runtime is found", ...)
before a command says anything of its own. For ``megatron-ext`` commands (and
``pretrain_gpt_ext.py --help``) they are noise: the commands work the same with or without
those packages. Training logs keep them: they say which kernels a run falls back to, so
nothing here is ever called on a training path, and the filters are per process (training
launched by ``demo``/``train``/``supervise`` runs in its own processes, unfiltered).
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
