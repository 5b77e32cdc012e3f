"""Offline data preparation: a synthetic corpus, a locally trained BPE tokenizer, JSONL ->
Megatron ``.bin``/``.idx`` (``megatron-ext preprocess``), provenance and blocklists."""
