"""Launch policy in Python: ``megatron-ext supervise``, which both launchers exec.

``knobs`` (the environment variables), ``policy`` (the exit-code table as pure functions),
``commands`` (torchrun / srun command lines), ``runner`` (the attempt loop). Imports neither
torch nor Megatron, so the supervisor starts in a fraction of a second.
"""
