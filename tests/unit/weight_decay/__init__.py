"""Unit tests of megatron_ext/weight_decay/."""
