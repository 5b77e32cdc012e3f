"""Per-parameter weight-decay multipliers (OLMo 2: no decay on embeddings): ``core`` is the
policy (no Megatron import), ``adapter`` its flags, param groups, start-up map and resume check.
"""
