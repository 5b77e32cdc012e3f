"""Unit tests of megatron_ext/zloss/."""
