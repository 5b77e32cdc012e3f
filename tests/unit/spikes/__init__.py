"""Unit tests of megatron_ext/spikes/."""
