"""Sample-id reverse lookup: iteration + DP rank -> samples, documents and tokens, and back.

One module per concept:

- run configuration: ``config`` (checkpoint args / Megatron flags -> :class:`RunConfig`),
  ``flagspec`` (Megatron's parser, rebuilt), ``formats`` (Megatron's file formats and data-flag
  rules, without importing Megatron);
- layout history: ``history`` (which DP size and batch sizes trained each iteration);
- index files: ``caches`` (finding a run's caches by their descriptions), ``indices`` (the
  memory-mapped caches and .bin/.idx, checked and resolved to documents), ``rebuild``
  (``--rebuild-caches`` through Megatron's own builder);
- sample position: ``position`` (iteration <-> sampler stream), ``cyclic`` (the cyclic
  sampler's order), ``topology`` (which global ranks read);
- rendering: ``render`` (records, tables, atomic files);
- the command: ``session`` (one invocation, and a batch followed from iteration to tokens),
  ``crosscheck`` (``--sample-log``), ``worst`` (``--worst``), ``inverse`` (document ->
  samples), ``cli``.
"""
