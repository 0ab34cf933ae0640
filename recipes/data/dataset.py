"""Training samples: token sequences of seq_length + 1 (inputs are [:-1], labels [1:]), indexable without end.

Any sample index is valid, so a run may last several epochs and resume from any sample without replaying the ones
before it: sample i of a dataset with n distinct samples is sample i % n of epoch i // n, and each epoch's order
is a function of (seed, epoch) alone.
"""

from __future__ import annotations

import sys
from typing import Protocol

import numpy as np

from recipes.config import ConfigError, DataConfig, DataKind
from recipes.data import tokenizer
from recipes.data.corpus import build_corpus
from recipes.data.index_check import check_one_sample, existing_prefix
from recipes.data.megatron_indexed import IndexedDataset


class SequenceDataset(Protocol):
    def __len__(self) -> int:
        """Distinct samples (one epoch); larger indices are valid too."""

    def __getitem__(self, i: int) -> np.ndarray:
        """Sample i: int64 token ids, seq_length + 1 of them."""


def make_dataset(cfg: DataConfig, seq_length: int, vocab_size: int, seed: int) -> SequenceDataset:
    """The samples `cfg` names, for a model with this context length and vocabulary, in the order `seed` picks."""
    if cfg.kind == DataKind.mock:
        return MockSequences(seq_length, vocab_size, seed)
    if cfg.path is None:
        # Known without reading the tokens, so a too-small vocabulary fails here rather than at some later sample.
        _check_vocab(tokenizer.VOCAB_SIZE - 1, vocab_size, "the bundled corpus (byte tokenizer)")
        prefix = build_corpus(cfg.cache_dir)
    else:
        prefix = existing_prefix(cfg.path)
    return PackedSequences(IndexedDataset(prefix), seq_length, vocab_size, seed)


class PackedSequences:
    """An indexed dataset's documents back to back (GPT-style packing: the EOD tokens stored in the data separate
    them), cut into non-overlapping windows of seq_length + 1 tokens, a partial last window dropped.

    Tokens stay in megatron-core's memory-mapped .bin file; a sample reads only its own window.
    """

    def __init__(self, tokens: IndexedDataset, seq_length: int, vocab_size: int, seed: int) -> None:
        self._tokens = tokens
        self._window = seq_length + 1
        self._vocab_size = vocab_size
        self._seed = seed
        # Where each stored sequence ends and starts in the concatenated token stream.
        self._ends = np.cumsum(tokens.sequence_lengths, dtype=np.int64)
        self._starts = self._ends - tokens.sequence_lengths
        total = int(self._ends[-1])
        check_one_sample(total, seq_length, tokens.path_prefix)
        self._num_windows = total // self._window
        self._epoch_order = (-1, np.empty(0, dtype=np.int64))

    def __len__(self) -> int:
        return self._num_windows

    def __getitem__(self, i: int) -> np.ndarray:
        _check_index(i)
        epoch, position = divmod(int(i), self._num_windows)
        window = self._read(int(self._order(epoch)[position]) * self._window)
        # Every token the model sees is checked: an id past the embedding table would otherwise surface as a
        # device-side assert (GPU) or an IndexError deep inside the model. Scanning the whole dataset up front
        # would cost a full read of it on every rank at every start.
        _check_vocab(int(window.max()), self._vocab_size, f"the dataset at {self._tokens.path_prefix}")
        return window

    def _order(self, epoch: int) -> np.ndarray:
        # One epoch's permutation is kept: consecutive samples share it, and a run enters each epoch once.
        # Stored as one tuple so that a concurrent reader never pairs an epoch with another epoch's order.
        cached_epoch, order = self._epoch_order
        if cached_epoch != epoch:
            order = np.random.default_rng((self._seed, epoch)).permutation(self._num_windows)
            self._epoch_order = (epoch, order)
        return order

    def _read(self, start: int) -> np.ndarray:
        """Tokens [start, start + window) of the stream, which may span several stored sequences."""
        end = start + self._window
        sequence = int(np.searchsorted(self._ends, start, side="right"))
        pieces = []
        while start < end:
            count = min(end, int(self._ends[sequence])) - start
            pieces.append(self._tokens.get(sequence, offset=start - int(self._starts[sequence]), length=count))
            start += count
            sequence += 1
        # A copy, not views: megatron-core's arrays point into an mmap that it unmaps when the dataset goes away.
        return np.concatenate(pieces, dtype=np.int64)


class MockSequences:
    """Uniformly random tokens, a function of (seed, i): for throughput runs, where data content does not matter."""

    def __init__(self, seq_length: int, vocab_size: int, seed: int) -> None:
        self._length = seq_length + 1
        self._vocab_size = vocab_size
        self._seed = seed

    def __len__(self) -> int:
        return sys.maxsize  # no epochs: every index is a new sample

    def __getitem__(self, i: int) -> np.ndarray:
        _check_index(i)
        rng = np.random.default_rng((self._seed, int(i)))
        return rng.integers(0, self._vocab_size, size=self._length, dtype=np.int64)


def _check_vocab(max_token: int, vocab_size: int, source: str) -> None:
    if max_token >= vocab_size:
        raise ConfigError(
            f"{source} has token id {max_token}, but model.vocab_size is {vocab_size}: the embedding has no row for "
            f"it. Use a model with vocab_size > {max_token}, or data tokenized with this model's tokenizer."
        )


def _check_index(i: int) -> None:
    if i < 0:
        raise IndexError(f"sample index must be >= 0, got {i}")
