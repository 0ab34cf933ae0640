"""Training data for the torch engine: the bundled real-text corpus (`corpus.build_corpus`), Megatron indexed
datasets, mock tokens. `dataset.make_dataset(cfg.data, seq_length, vocab_size, seed)` is all an engine needs;
sample i is a fixed function of (data, seed, i), so resuming at any sample index reproduces the run.

Nothing is imported here: megatron-core's indexed-dataset reader (`megatron_indexed`) takes seconds to import, and
the plan, which only checks an index (`index_check`), must not pay for it.
"""
