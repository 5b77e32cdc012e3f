"""Unit tests of megatron_ext/sample_log/."""
