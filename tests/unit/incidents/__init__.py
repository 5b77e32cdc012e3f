"""Unit tests of megatron_ext/incidents/."""
