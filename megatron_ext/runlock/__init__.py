"""The run lock's training side (:mod:`.adapter`); the lease is in
:mod:`megatron_ext.common.run_lock`, shared with the supervisor and ``skiplist --apply``."""
