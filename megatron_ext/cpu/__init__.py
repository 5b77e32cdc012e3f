"""The CPU runner: megatron-core's real ``pretrain`` loop on CPU with gloo. ``megatron-ext
demo`` and ``train --cpu`` point ``torchrun`` at :mod:`run`, which installs :mod:`shims`; nothing
else imports this package (tests/unit/test_architecture.py), so a GPU run never loads it.
"""
