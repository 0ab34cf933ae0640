"""An FP8 GEMM operand: FP8 values, laid out (rows, K) row-major, and the scales that decode them.

`scale_inv` multiplies the FP8 values back to the original ones. Its shape says the granularity:
    ()                        one scale for the tensor (per-tensor recipes)
    (rows, K / 128)           1 x 128 blocks along K (blockwise activations and gradients)
    (rows / 128, K / 128)     128 x 128 blocks (blockwise weights)
    (rows, K / 32)            1 x 32 blocks along K with power-of-two scales (MXFP8)
    (rows, 1)                 one scale per row, all of K (row-wise scaling; block ROW_BLOCK, -1 as in reshape)
    (rows / 16 or rows, K/16) NVFP4: `data` holds E2M1 codes two to a byte, (rows, K / 2) uint8; `scale_inv` the
                              E4M3 scales of its 16 x 16 or 1 x 16 blocks; `tensor_scale_inv` the FP32 decoding
                              scale of the whole tensor, NVFP4's second level (None for every other format)
Scales always run along K, the dimension the GEMM contracts: an operand quantized for one GEMM is valid for
another only if its blocks still run along that GEMM's K (true for per-tensor and 128 x 128, false otherwise).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from recipes.fp8.formats import e2m1_values, pack_e2m1, unpack_e2m1

ROW_BLOCK = (1, -1)  # a row-wise scaled operand's block: one row, the whole of K


class Float8Tensor(NamedTuple):
    data: torch.Tensor  # FP8 values, (rows, K)
    scale_inv: torch.Tensor  # FP32 decoding scales, shape per granularity (see above)
    block: Optional[tuple[int, int]] = None  # (block rows, block cols); None: one scale for the tensor
    tensor_scale_inv: Optional[torch.Tensor] = None  # NVFP4's per-tensor FP32 decoding scale

    @property
    def is_fp4(self) -> bool:
        return self.tensor_scale_inv is not None

    def values(self) -> torch.Tensor:
        """The stored values (rows, K) in FP32, before any scale."""
        return e2m1_values(self.data) if self.is_fp4 else self.data.float()

    def block_scaled(self) -> torch.Tensor:
        """FP32 values times their block scales: all of dequantize but NVFP4's per-tensor scale."""
        values = self.values()
        if self.block is None:
            return values
        (block_rows, block_cols), (rows, cols) = self.block, values.shape
        block_cols = cols if block_cols == -1 else block_cols
        blocks = values.view(rows // block_rows, block_rows, cols // block_cols, block_cols)
        return (blocks * self.scale_inv.float()[:, None, :, None]).view(rows, cols)  # quantization made them divide

    def dequantize(self) -> torch.Tensor:
        """FP32 values: the independent reference of every FP8 GEMM, and its emulation where none is native."""
        if self.block is None:
            return self.data.float() * self.scale_inv
        if self.is_fp4:
            return self.block_scaled() * self.tensor_scale_inv
        return self.block_scaled()

    def transpose(self) -> "Float8Tensor":
        """The same values laid out (K, rows): valid only where the blocks are symmetric (per tensor, 128x128,
        NVFP4's 16x16). FP8 bytes are moved as they are; FP4 codes are unpacked, moved and packed again."""
        if self.block is not None and self.block[0] != self.block[1]:
            raise ValueError(f"a {self.block} block-scaled operand must be quantized again along its new K")
        scale_inv = self.scale_inv if self.block is None else self.scale_inv.t().contiguous()
        data = pack_e2m1(unpack_e2m1(self.data).t()) if self.is_fp4 else self.data.t()
        return Float8Tensor(data.contiguous(), scale_inv, self.block, self.tensor_scale_inv)
