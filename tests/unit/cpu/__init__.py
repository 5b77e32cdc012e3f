"""Unit tests of megatron_ext/cpu/."""
