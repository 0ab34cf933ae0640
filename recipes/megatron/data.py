"""Training samples for engine=megatron through megatron-core's dataset builders.

data=text: the repo's Megatron indexed dataset (the bundled byte-tokenized corpus, or data.path) as a GPTDataset;
data=mock: MockGPTDataset. Both come from BlendedMegatronDatasetBuilder, as in Megatron-LM's pretrain_gpt.py.
The tokens are already ids; the tokenizer only tells the dataset the vocabulary and the end-of-document id.

Sample i of the run is the same function of (data, seed, i) on every rank (megatron-core's shuffle, not the torch
engine's), and the samples of a step follow the torch engine's rule: data-parallel rank r takes its slice of each
global batch (MicroBatches), so a resumed run reads exactly what an uninterrupted one would.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from recipes.config import Config, ConfigError, DataKind
from recipes.data import tokenizer
from recipes.data.corpus import build_corpus
from recipes.data.index_check import existing_prefix
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset


@dataclass(frozen=True)
class ByteTokenizer:
    """What megatron-core's datasets ask of a tokenizer: the repo's byte tokenizer's vocabulary size and
    end-of-document id (recipes.data.tokenizer); no padding id. megatron-core's own "null" tokenizer has the same
    ids but another name in each version ("null" in 0.16, "null-text" in 0.19)."""

    vocab_size: int = tokenizer.VOCAB_SIZE
    eod: int = tokenizer.EOD

    @property
    def unique_identifiers(self) -> dict:
        """Part of the key under which megatron-core caches a dataset's sample index."""
        return {"class": type(self).__name__, "vocab_size": self.vocab_size, "eod": self.eod}


def dataset_config(cfg: Config, prefix: str | None) -> GPTDatasetConfig:
    cache = Path(cfg.data.cache_dir).expanduser() / "megatron-index"
    return GPTDatasetConfig(
        random_seed=cfg.trainer.seed,
        sequence_length=cfg.model.seq_length,
        blend=([prefix], None) if prefix else None,
        split="100,0,0",  # every document is training data
        tokenizer=ByteTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,  # causal masking happens inside attention; no S x S mask tensor
        path_to_cache=str(cache),
        mid_level_dataset_surplus=0.005,
    )


def build_train_dataset(cfg: Config, rank: int) -> GPTDataset:
    """The run's training samples (max_steps x global batch of them). Rank 0 builds megatron-core's index files
    first; the other ranks then read them from the cache."""
    if cfg.model.vocab_size < tokenizer.VOCAB_SIZE:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the byte tokenizer's "
                          f"{tokenizer.VOCAB_SIZE} ids")
    if cfg.data.kind == DataKind.mock:
        prefix, cls = None, MockGPTDataset
    else:
        prefix = existing_prefix(cfg.data.path) if cfg.data.path else build_corpus(cfg.data.cache_dir)
        cls = GPTDataset
    samples = cfg.trainer.max_steps * cfg.trainer.global_batch_size
    config = dataset_config(cfg, str(prefix) if prefix else None)
    dataset = None
    if rank == 0:
        (dataset, _, _) = BlendedMegatronDatasetBuilder(cls, [samples, 0, 0], lambda: True, config).build()
    if dist.is_initialized():
        dist.barrier()
    if rank != 0:
        (dataset, _, _) = BlendedMegatronDatasetBuilder(cls, [samples, 0, 0], lambda: True, config).build()
    return dataset


class MicroBatches:
    """The micro-batches of one data-parallel rank, as the torch engine reads them: step s (1-based) takes samples
    [(s - 1) x gbs, s x gbs), micro-batch m of data-parallel rank r the mbs samples at (m x dp + r) x mbs."""

    def __init__(self, dataset: GPTDataset, cfg: Config, dp_rank: int, dp_size: int):
        self.dataset, self.dp_rank, self.dp_size = dataset, dp_rank, dp_size
        self.mbs, self.gbs = cfg.trainer.micro_batch_size, cfg.trainer.global_batch_size

    def get(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        first = (step - 1) * self.gbs + (micro * self.dp_size + self.dp_rank) * self.mbs
        samples = [self.dataset[first + j] for j in range(self.mbs)]
        return {key: torch.stack([s[key] for s in samples]) for key in ("tokens", "labels", "loss_mask", "position_ids")}

    def of_step(self, step: int, count: int) -> Iterator[dict[str, torch.Tensor]]:
        return (self.get(step, micro) for micro in range(count))
