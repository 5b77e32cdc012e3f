"""Unit tests of megatron_ext/supervise/."""
