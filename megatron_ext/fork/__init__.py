"""megatron-ext in a pretrain script of your own (a Megatron-LM fork's ``pretrain_gpt.py``): the
script keeps its forward step, loss, batch, model and datasets, calls
``Overlay().pretrain(...)`` instead of Megatron's ``pretrain`` and ``overlay.forward(model)`` in
its forward step, and gets every feature (docs/fork.md; ``docs/examples/pretrain_gpt_fork.py``).
"""

from megatron_ext.fork.overlay import Forward, Overlay, ScriptError

__all__ = ["Forward", "Overlay", "ScriptError"]
