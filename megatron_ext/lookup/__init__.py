"""Sample-id reverse lookup: iteration + DP rank -> samples, documents and tokens, and back.

``position`` (batch arithmetic, no Megatron), ``cyclic`` (the cyclic sampler's order),
``topology`` (which ranks read), ``indices`` (memory-mapped caches, fingerprint checks,
resolution), ``inverse`` (document -> samples), ``config`` (checkpoint args / Megatron flags),
``adapter`` (explicit cache rebuilds through Megatron's builder),
``render``/``crosscheck``/``cli`` (``megatron-ext lookup``).
"""
