"""Torch FSDP2 (``--use-torch-fsdp2``): what megatron-core gets wrong under it, put right."""
