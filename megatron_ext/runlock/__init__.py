"""The run lock: one writer per checkpoint directory (core :mod:`.lease`, training side
:mod:`.adapter`)."""
