"""An FP8 GEMM operand: FP8 values, laid out (rows, K) row-major, and the scales that decode them.

`scale_inv` multiplies the FP8 values back to the original ones. Its shape says the granularity:
    ()                        one scale for the tensor (per-tensor recipes)
    (rows, K / 128)           1 x 128 blocks along K (blockwise activations and gradients)
    (rows / 128, K / 128)     128 x 128 blocks (blockwise weights)
    (rows, K / 32)            1 x 32 blocks along K with power-of-two scales (MXFP8)
    (rows, 1)                 one scale per row, all of K (row-wise scaling; block ROW_BLOCK, -1 as in reshape)
    () with a block           NVFP4, emulated: `data` holds each E2M1 value times its block's E4M3 scale in BF16
                              (exact), `scale_inv` the tensor's decode scale, `block` its 1x16 or 16x16 blocks
Scales always run along K, the dimension the GEMM contracts: an operand quantized for one GEMM is valid for
another only if its blocks still run along that GEMM's K (true for per-tensor and 128 x 128, false otherwise).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

ROW_BLOCK = (1, -1)  # a row-wise scaled operand's block: one row, the whole of K


class Float8Tensor(NamedTuple):
    data: torch.Tensor  # FP8 values, (rows, K)
    scale_inv: torch.Tensor  # FP32 decoding scales, shape per granularity (see above)
    block: Optional[tuple[int, int]] = None  # (block rows, block cols); None: one scale for the tensor

    def dequantize(self) -> torch.Tensor:
        """FP32 values: the independent reference of every FP8 GEMM, and its emulation where none is native."""
        if self.block is None or self.scale_inv.dim() == 0:
            return self.data.float() * self.scale_inv
        (block_rows, block_cols), (rows, cols) = self.block, self.data.shape
        block_cols = cols if block_cols == -1 else block_cols
        blocks = self.data.float().view(rows // block_rows, block_rows, cols // block_cols, block_cols)
        return (blocks * self.scale_inv[:, None, :, None]).view(rows, cols)  # quantization made the blocks divide

    def transpose(self) -> "Float8Tensor":
        """The same FP8 bytes laid out (K, rows): valid only where the blocks are symmetric (per tensor, 128x128)."""
        if self.block is not None and self.block[0] != self.block[1]:
            raise ValueError(f"a {self.block} block-scaled operand must be quantized again along its new K")
        scale_inv = self.scale_inv if self.block is None else self.scale_inv.t().contiguous()
        return Float8Tensor(self.data.t().contiguous(), scale_inv, self.block)
