"""megatron-ext in a pretrain script of your own (a Megatron-LM fork's ``pretrain_gpt.py``).

The script keeps its own forward step, loss, batch, model and datasets; a few lines give it
every feature (docs/fork.md, tested end to end with ``docs/examples/pretrain_gpt_fork.py``)::

    from megatron_ext.fork import Overlay

    overlay = Overlay()

    def forward_step(data_iterator, model):
        forward = overlay.forward(model)             # this micro-batch, as the features see it
        ...  # in get_batch, on TP rank 0: batch = forward.read(data_iterator)
        output_tensor = model(tokens, position_ids, attention_mask, labels=labels, ...)
        return output_tensor, forward.loss(partial(loss_func, loss_mask), loss_mask)

    overlay.pretrain(datasets_provider, model_provider, ModelType.encoder_or_decoder,
                     forward_step)                   # instead of Megatron's pretrain

:meth:`Overlay.pretrain` adds the overlay's flags to the script's, resolves the skip lists,
installs the features on Megatron's own args and calls the installed megatron-core's
``pretrain`` (:mod:`megatron_ext.fork.start`, which ``pretrain_gpt_ext.py`` runs too).
"""

from megatron_ext.fork.overlay import Forward, Overlay, ScriptError

__all__ = ["Forward", "Overlay", "ScriptError"]
