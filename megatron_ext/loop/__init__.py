"""The training loop's side of the overlay: the entry point's runners (:mod:`.entry`), the
features' installer (:mod:`.install`, which applies the registry's patches) and the GPT step
and model handed to Megatron (:mod:`.gpt_step`, :mod:`.gpt_model`)."""
