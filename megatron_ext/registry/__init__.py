"""Every touch of Megatron internals, in one folder: the table (:mod:`.table`, with the entry
point's part in :mod:`.entry`, FSDP's in :mod:`.fsdp`, private names relied on in
:mod:`.assumptions`, copied logic in :mod:`.copies`), the machinery that applies and verifies
them (:mod:`.patching`, :mod:`.copy_check`), the upstream bug fixes (:mod:`.fixes`) and the
``megatron-ext patches`` report (:mod:`.report`).

Imports nothing here: the CPU harness loads :mod:`.patching` before megatron-core exists.
"""
