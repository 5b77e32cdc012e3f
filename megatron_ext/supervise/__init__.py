"""Launch policy in Python: ``megatron-ext supervise``, which both launchers call.

``knobs`` (every environment variable and its default, declared once), ``policy`` (the
exit-code table as pure functions), ``commands`` (torchrun / srun command lines, host lists),
``runner`` (the attempt loop, signals and actions). Imports neither torch nor Megatron, so
the supervisor starts in a fraction of a second.
"""
