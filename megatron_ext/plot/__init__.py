"""``megatron-ext plot`` (:mod:`.draw`): reads the signals log once into per-pixel-column
envelopes (:mod:`.stream`, :mod:`.envelope`, per-source columns in :mod:`.sources`) and draws
the panels (:mod:`.axes`). A command: it may import any layer."""
