"""engine=megatron (engine.py: `python -m recipes.megatron.engine RUN_DIR/config.yaml`): the resolved config as
megatron-core objects (translate), the model and parallel state built from them (build), data through
megatron-core's dataset builders (data), distributed checkpoints (checkpoint).

Importing this package imports megatron.core once, without the warning it prints when Transformer Engine and Apex
are missing: the local layer spec needs neither, and whether FP8 can run is decided in recipes.plan, with a fix.
"""

import warnings

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    from megatron.core import parallel_state

__all__ = ["parallel_state"]
