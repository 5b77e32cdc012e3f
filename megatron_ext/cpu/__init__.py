"""The CPU runner: megatron-core's real ``pretrain`` loop on CPU with gloo.

``megatron-ext demo`` and ``megatron-ext train --cpu`` point ``torchrun`` at :mod:`run`
(by path, :data:`megatron_ext.train.CPU_RUNNER`), which installs :mod:`shims` and then runs
``pretrain_gpt_ext.py``; the test suite trains through it the same way. Nothing else imports
this package: a GPU run never loads it (tests/unit/test_architecture.py checks both).
"""
