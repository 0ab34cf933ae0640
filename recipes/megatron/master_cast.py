"""The distributed optimizer's cast of FP32 master shards into FP8 weights, without Transformer Engine's fallback
kernel.

With FP8 primary weights (precision.fp8_param_gather), megatron-core's distributed optimizer casts each weight's
FP32 master shard into the FP8 weight after every step (fp8_utils.quantize_param_shard -> TE's
cast_master_weights_to_fp8). For the per-tensor recipes TE 2.20 quantizes each flat shard with a quantizer that also
asks for the transpose (columnwise usage: the current-scaling path builds Float8Quantizer with its defaults, the
delayed one uses the weight's own quantizer). On Hopper that makes TE allocate a transpose of the 1 x N shard and
run its general cast-transpose kernel, `cast_transpose_general_kernel`: about 4 ms per weight of the 8B proxy, 127
ms per step, where a plain cast runs at the copy rate. The transpose is thrown away: megatron-core keeps TE from
touching the weights' own (manual_post_all_gather_processing) and rebuilds it from the whole weight after the
all-gather (post_all_gather_processing).

`install()` wraps megatron-core's cast so that it asks TE for the row-major bytes alone: same kernels for amax and
scale, same bytes and scales (a GPU test compares them with TE's own path), no transpose.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch


@contextlib.contextmanager
def rowwise_master_casts(model_params: list[torch.Tensor]) -> Iterator[None]:
    """While inside: quantizers TE builds with default usage are row-wise only, and so are the per-tensor FP8
    weights' own quantizers among `model_params` (delayed scaling casts with those); both restored on the way out."""
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer, Float8Tensor

    own = [p._quantizer for p in model_params if isinstance(p, Float8Tensor) and p._quantizer is not None]
    usages = [(q.rowwise_usage, q.columnwise_usage) for q in own]
    build = Float8Quantizer.__init__

    @functools.wraps(build)
    def rowwise_by_default(self, *args, rowwise: bool = True, columnwise: bool = False, **kwargs):
        build(self, *args, rowwise=rowwise, columnwise=columnwise, **kwargs)

    Float8Quantizer.__init__ = rowwise_by_default
    for quantizer in own:
        quantizer.set_usage(rowwise=True, columnwise=False)
    try:
        yield
    finally:
        Float8Quantizer.__init__ = build
        for quantizer, (rowwise, columnwise) in zip(own, usages):
            quantizer.set_usage(rowwise=rowwise, columnwise=columnwise)


def install() -> None:
    """Route megatron-core's master-shard cast (fp8_utils._quantize_param_shard_impl, which its quantize_param_shard
    calls) through rowwise_master_casts; once per process."""
    from megatron.core import fp8_utils

    cast = fp8_utils._quantize_param_shard_impl
    if getattr(cast, "rowwise_only", False):
        return

    @functools.wraps(cast)
    def rowwise_cast(model_params, *args, **kwargs):
        with rowwise_master_casts(model_params):
            cast(model_params, *args, **kwargs)

    rowwise_cast.rowwise_only = True
    fp8_utils._quantize_param_shard_impl = rowwise_cast
