"""Unit tests of megatron_ext/data/."""
