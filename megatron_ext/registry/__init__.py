"""Every touch of Megatron internals, in one folder: the table (:mod:`.table`), its mechanism
(:mod:`.patching`), the copies of Megatron logic (:mod:`.copies`), the wrappers of the
registry's own patches (:mod:`.fixes`) and of the loop hooks (:mod:`.hooks`). Below
:mod:`megatron_ext.loop`; imports nothing here (the CPU runner loads :mod:`.patching` first).
"""
