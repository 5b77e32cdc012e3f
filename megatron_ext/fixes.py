"""Upstream megatron-core bugs the overlay fixes at start-up, each registered as a patch.

Each fix states the symptom, who hits it and why the fix is safe; ``megatron-ext patches``
lists them. They apply whenever ``pretrain_gpt_ext.py`` runs, because they fix behaviour
that plain Megatron gets wrong with the pip wheel, not features.
"""

from __future__ import annotations

from typing import Any, Callable

from megatron_ext.patches import Patch, register


def _skip_make_when_prebuilt(original: Callable[[], None]) -> Callable[[], None]:
    def compile_helpers() -> None:
        """Use the wheel's prebuilt ``helpers_cpp``; only fall back to ``make`` without it."""
        try:
            from megatron.core.datasets import helpers_cpp  # noqa: F401
        except ImportError:
            original()

    return compile_helpers


COMPILE_HELPERS = register(
    Patch(
        name="prebuilt-dataset-helpers",
        target="megatron.core.datasets.utils:compile_helpers",
        kind="bugfix",
        reason=(
            "initialize_megatron runs `make` in the installed package, but the pip wheel ships "
            "a prebuilt helpers_cpp and no Makefile, so every wheel user's start-up exits(1). "
            "Skip the build when the prebuilt extension imports."
        ),
        signature="()",
        wrap=_skip_make_when_prebuilt,
    )
)

BUGFIXES: tuple[Patch, ...] = (COMPILE_HELPERS,)


