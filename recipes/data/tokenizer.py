"""A byte-level tokenizer: token id = UTF-8 byte value, plus one end-of-document id.

A run must not download anything (no tokenizer from a model hub), and bytes need no vocabulary file, never meet an
unknown character and round-trip any text exactly. Sequences are about 4x longer than with a BPE tokenizer, which
costs nothing here: the bundled corpus exists to give loss curves real structure, not to train a useful model.
"""

from __future__ import annotations

import numpy as np

EOD = 256  # end of document: separates documents packed into one training sequence
VOCAB_SIZE = 257
EOD_TEXT = "<|endoftext|>"  # how `decode` shows EOD, as GPT-2's tokenizer shows its own


def encode(text: str | bytes) -> np.ndarray:
    """Token ids (int64) of `text`: its UTF-8 bytes. Bytes are taken as they are, whatever their encoding."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    return np.frombuffer(data, dtype=np.uint8).astype(np.int64)


def decode(ids) -> str:
    """Text of token ids; EOD shows as EOD_TEXT, and bytes that are not valid UTF-8 as U+FFFD (a model's samples
    need not be valid UTF-8)."""
    ids = np.asarray(ids, dtype=np.int64).ravel()
    if ids.size and (ids.min() < 0 or ids.max() >= VOCAB_SIZE):
        raise ValueError(f"token ids must be in [0, {VOCAB_SIZE}), got min {ids.min()}, max {ids.max()}")
    # Decode each document on its own, so a multi-byte character cannot straddle an EOD.
    eods = np.flatnonzero(ids == EOD)
    starts, ends = np.r_[0, eods + 1], np.r_[eods, ids.size]
    return EOD_TEXT.join(_utf8(ids[start:end]) for start, end in zip(starts, ends))


def _utf8(byte_ids: np.ndarray) -> str:
    return byte_ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
