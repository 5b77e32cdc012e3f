"""Spikes: what runs inside training when the loss jumps: the streaming detector, early
warning, update skip, skip lists and the drill. The offline rollback + skip planner is in
:mod:`megatron_ext.incidents`."""
