"""What a dataset is, independent of the path that names it: the sizes of its two files, a digest of its index and
a digest of evenly spaced pieces of its tokens.

A resumed run must read the samples the run read before (sample i is a function of the data and the seed). A path
compared as a string says nothing of that: a relative path names another dataset from another folder, and a
dataset rebuilt in place keeps its path. The index (.idx) holds every document's length and offset; two corpora of
documents of equal lengths share it, so pieces of the tokens (.bin) are digested too. Either way only megabytes are
read, even for a large corpus.
"""

from __future__ import annotations

import hashlib
import os
from typing import Optional

from recipes.config import DataConfig, DataKind
from recipes.data.corpus import build_corpus
from recipes.data.index_check import existing_prefix

PIECES, PIECE_BYTES = 16, 1 << 16  # of the .bin: 1 MiB read at most


def dataset_identity(cfg: DataConfig) -> Optional[dict]:
    """Sizes and digests of the indexed dataset `cfg` reads (the bundled corpus built if it is not cached yet);
    None for mock data, which is a function of the seed alone."""
    if cfg.kind == DataKind.mock:
        return None
    prefix = existing_prefix(cfg.path) if cfg.path is not None else build_corpus(cfg.cache_dir)
    index, tokens = hashlib.sha256(), hashlib.sha256()
    with open(prefix + ".idx", "rb") as file:
        while chunk := file.read(1 << 24):
            index.update(chunk)
    size = os.path.getsize(prefix + ".bin")
    with open(prefix + ".bin", "rb") as file:
        for piece in range(PIECES):
            file.seek(size * piece // PIECES)
            tokens.update(file.read(PIECE_BYTES))
    return {"bin_bytes": size, "idx_bytes": os.path.getsize(prefix + ".idx"), "idx_sha256": index.hexdigest(),
            "bin_pieces_sha256": tokens.hexdigest()}
