"""Offline data preparation: a synthetic corpus, a locally trained BPE tokenizer, and
JSONL -> Megatron ``.bin``/``.idx`` preprocessing (``megatron-ext preprocess``).

Everything here runs without network access so smoke-test pretraining runs are reproducible
on air-gapped machines; the tokenizer is saved in a format Megatron loads natively
(``--tokenizer-type HuggingFaceTokenizer``).
"""
