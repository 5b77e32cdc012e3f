"""Unit tests of megatron_ext/lookup/."""
