"""The run lock's training side: rank 0 holds ``--save`` before any feature writes there
(:mod:`.adapter`). The lease itself is in the lower layer, :mod:`megatron_ext.common.run_lock`,
because the supervisor and ``skiplist --apply`` take the same lease."""
