"""Sample-id reverse lookup: iteration + DP rank -> samples, documents and tokens, and back.

One module per concept, in layers, highest first; a module imports only modules of the
layers below it (tests/unit/lookup/test_lookup_layers.py holds this order), so a batch walk
goes down and never back up (``session``'s docstring follows one batch):

1. the command: ``cli``;
2. what an answer is checked against or turned into: ``crosscheck`` (``--sample-log``),
   ``worst`` (``--worst``), ``blocklist`` (``--emit-blocklist``), ``inverse`` (document ->
   samples);
3. one invocation: ``session`` (the run, its tokenizer, and a batch followed from iteration
   to tokens);
4. ``rebuild`` (``--rebuild-caches`` through Megatron's own builder);
5. the run: ``config`` (checkpoint args / Megatron flags -> :class:`RunConfig`), ``attempts``
   (which attempt trained an iteration);
6. ``history`` (the layout each stretch of the run trained with);
7. ``indices``: opening the index (caches memory-mapped and checked against the
   ``.bin``/``.idx``), and its blend level (global sample -> dataset and sample);
8. ``caches``: finding the caches by their descriptions;
9. ``tokenizer`` (``--text``, and the identifiers caches are told apart by), ``render``
   (records, tables, atomic files);
10. ``dataset``: one GPTDataset, a sample -> documents, token spans and tokens;
11. ``position`` (iteration <-> sampler stream), ``cyclic`` (the cyclic sampler's order),
    ``topology`` (which global ranks read), ``gaps`` (sample-log outages), ``flagspec``
    (Megatron's parser, rebuilt);
12. ``formats``: Megatron's files (the ``.bin``/``.idx`` documents and tokens, the caches'
    descriptions and arrays) and data-flag rules, without importing Megatron;
13. ``errors``: the refusals.
"""
