"""``megatron-ext plot`` (:mod:`.draw`): reads the signals log once into per-pixel-column
envelopes (:mod:`.stream`) and draws the panels. A command: it may import any layer."""
