"""megatron-core's indexed dataset (.bin/.idx) classes, imported without its Transformer Engine/Apex warnings.

Importing anything under `megatron.core` runs `megatron/core/__init__.py`, which imports the training code and warns
that Transformer Engine and Apex are missing (and, where logging is at INFO, which Megatron-FSDP backend it found). Reading and writing token files uses neither, so on a machine without
them (a laptop, the CPU test suite, the torch engine) those warnings would only suggest a problem that is not there.
"""

import logging
import warnings

_megatron_logger = logging.getLogger("megatron")
_level = _megatron_logger.level
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    _megatron_logger.setLevel(logging.WARNING)  # its import logs Megatron-FSDP's backend at INFO (the launcher's level)
    try:
        from megatron.core.datasets.indexed_dataset import (
            IndexedDataset,
            IndexedDatasetBuilder,
            get_bin_path,
            get_idx_path,
        )
    finally:
        _megatron_logger.setLevel(_level)

__all__ = ["IndexedDataset", "IndexedDatasetBuilder", "get_bin_path", "get_idx_path"]
