"""Unit tests, one folder per package folder (``tests/unit/zloss`` for ``megatron_ext/zloss``)."""
