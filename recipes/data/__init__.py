"""Training data for the torch engine: the bundled real-text corpus, Megatron indexed datasets, mock tokens.

`make_dataset(cfg.data, seq_length, vocab_size, seed)` is all an engine needs; sample i is a fixed function of
(data, seed, i), so resuming at any sample index reproduces the run.
"""

from recipes.data.corpus import build_corpus
from recipes.data.dataset import MockSequences, PackedSequences, SequenceDataset, make_dataset

__all__ = ["MockSequences", "PackedSequences", "SequenceDataset", "build_corpus", "make_dataset"]
