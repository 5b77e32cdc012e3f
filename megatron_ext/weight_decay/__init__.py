"""Per-parameter weight-decay multipliers (OLMo 2: no decay on embeddings).

Core (no Megatron import): ``core`` (the policy and its precedence rules). Megatron adapter:
``adapter`` (flags, param-group overrides, the start-up map and the resume check).
"""
