"""Cheap checks of a Megatron indexed dataset (PREFIX.idx, PREFIX.bin) before megatron-core opens it.

megatron-core's reader asserts on a bad header and otherwise trusts the index: a truncated .bin surfaces as a
numpy error at some later sample, and an index whose body is damaged (negative or wrong lengths, pointers past the
end, a .bin of another index) can even train. The .idx layout (megatron.core.datasets.indexed_dataset,
_IndexWriter.write):

    9 bytes  b"MMIDIDX\\x00\\x00"        8 bytes  version, 1 (little-endian uint64)
    1 byte   dtype code (DType)          8 bytes  sequence count S       8 bytes  document count D
    S int32  sequence lengths (tokens)   S int64  sequence pointers (byte offsets into .bin)
    D int64  document indices (0, ..., S: where each document's sequences start)

Everything here reads only the index (a memory map) and the .bin's size, so it costs a fraction of a second even
for a large corpus; and it imports no megatron-core, so the plan checks data.path before launch at no cost.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from recipes.config import ConfigError

HEADER = b"MMIDIDX\x00\x00"
HEADER_BYTES = len(HEADER) + 8 + 1 + 8 + 8
# megatron-core's DType codes and their item sizes.
ITEM_SIZE = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}


def existing_prefix(path: str) -> str:
    """The prefix of the indexed dataset data.path names, checked; ConfigError when it is missing or damaged."""
    prefix = str(Path(path).expanduser())
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"  # megatron-core's get_idx_path, get_bin_path
    if os.path.isfile(idx_path) and os.path.isfile(bin_path):
        check_indexed_dataset(prefix)
        return prefix
    hint = ""
    if prefix.endswith((".bin", ".idx")):
        hint = f"; data.path is the prefix without the extension: {prefix[:-4]}"
    raise ConfigError(
        f"data.path = {path!r}: no Megatron indexed dataset there (expected {bin_path} and {idx_path}){hint}. "
        "Leave data.path unset to use the bundled corpus."
    )


def check_indexed_dataset(prefix: str) -> None:
    """Raise ConfigError naming the file and what is wrong with it, unless PREFIX.idx/.bin are consistent."""
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    problem = _index_problem(idx_path, os.path.getsize(bin_path))
    if problem:
        raise ConfigError(f"data.path: {problem}; rebuild the dataset (Megatron's tools/preprocess_data.py) or "
                          "point data.path at an intact one")


def check_one_sample(tokens: int, seq_length: int, where: str) -> None:
    """ConfigError unless `tokens` hold one sample of seq_length + 1 (the plan checks it before launch too)."""
    if tokens < seq_length + 1:
        raise ConfigError(
            f"the dataset at {where} has {tokens} tokens, fewer than one sample of seq_length + 1 = "
            f"{seq_length + 1}; use a larger dataset (data.path) or a smaller model.seq_length"
        )


def token_count(prefix: str) -> int:
    """The tokens of a checked indexed dataset (check_indexed_dataset): its .bin's size over its token size."""
    with open(prefix + ".idx", "rb") as file:
        code = struct.unpack("<QB", file.read(HEADER_BYTES)[len(HEADER):len(HEADER) + 9])[1]
    return os.path.getsize(prefix + ".bin") // ITEM_SIZE[code]


def _index_problem(idx_path: str, bin_size: int) -> str | None:
    idx_size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as file:
        header = file.read(HEADER_BYTES)
    if len(header) < HEADER_BYTES or header[: len(HEADER)] != HEADER:
        return f"{idx_path} is not a Megatron index (its header is not {HEADER!r}...)"
    version, code, sequences, documents = struct.unpack("<QBQQ", header[len(HEADER):])
    if version != 1:
        return f"{idx_path} has index version {version}; only version 1 is known"
    if code not in ITEM_SIZE:
        return f"{idx_path} names token type code {code}, which megatron-core does not define"
    expected = HEADER_BYTES + 4 * sequences + 8 * sequences + 8 * documents
    if idx_size not in (expected, expected + sequences):  # + one int8 mode per sequence in multimodal indices
        return (f"{idx_path} is {idx_size} bytes, but its header ({sequences} sequences, {documents} documents) "
                f"needs {expected}: truncated or damaged")
    index = np.memmap(idx_path, mode="r", dtype=np.uint8)
    lengths = np.frombuffer(index, np.int32, sequences, HEADER_BYTES)
    pointers = np.frombuffer(index, np.int64, sequences, HEADER_BYTES + lengths.nbytes)
    starts = np.frombuffer(index, np.int64, documents, HEADER_BYTES + lengths.nbytes + pointers.nbytes)
    if sequences == 0:
        return f"{idx_path} holds no sequences"
    if (lengths < 0).any():
        return f"{idx_path} has {int((lengths < 0).sum())} negative sequence length(s): damaged"
    ends = pointers + lengths.astype(np.int64) * ITEM_SIZE[code]
    if (pointers < 0).any() or int(ends.max()) > bin_size:
        return (f"{idx_path} points past the end of {idx_path[:-4]}.bin ({bin_size} bytes; its sequences end at "
                f"byte {int(ends.max())}): the .bin is truncated or belongs to another index")
    # megatron-core writes the sequences back to back from byte 0: each pointer is where the previous one ends
    misplaced = pointers[1:] != ends[:-1]
    if pointers[0] != 0 or misplaced.any():
        wrong = 1 + int(np.argmax(misplaced)) if pointers[0] == 0 else 0
        return (f"{idx_path} has sequence lengths and pointers that disagree (sequence {wrong} starts at byte "
                f"{int(pointers[wrong])}, not where the one before it ends): damaged")
    if int(ends[-1]) != bin_size:
        return (f"{idx_path[:-4]}.bin is {bin_size} bytes, but its index's sequences end at byte {int(ends[-1])}: "
                "the .bin belongs to another index")
    if documents < 2 or starts[0] != 0 or starts[-1] != sequences or (np.diff(starts) < 0).any():
        return f"{idx_path} has damaged document indices (not rising from 0 to {sequences})"
    return None
