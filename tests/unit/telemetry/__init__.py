"""Unit tests of megatron_ext/telemetry/."""
