"""The training loop's side of the overlay: the entry point's wiring into megatron-core's
``pretrain`` (:mod:`.entry`), the features' installer (:mod:`.install`), the four loop-hook
wrappers (:mod:`.hooks`) and the GPT step and model the entry point hands to Megatron
(:mod:`.gpt_step`, :mod:`.gpt_model`). Same layer as :mod:`megatron_ext.registry`."""
