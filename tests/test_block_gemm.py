"""recipes.fp8.block_gemm, the Triton block-scaled FP8 GEMM (issue 49), in Triton's CPU interpreter: every block
pair the blockwise recipe trains with against an FP64 product of the same FP8 operands, odd M and N, zero blocks,
tiny and huge scales, BF16 and FP32 outputs, and adding into an FP32 output.

The bound: the kernel sums each 128-wide K step in FP32 (at most 128 products) and then adds K / 128 promoted
partial sums in FP32, so each output is within 2**-24 * (128 + K / 128) * sum_k |a_ik b_jk| of the exact product
(the standard bound for n FP32 additions, n <= 128 + K / 128, over the magnitudes' sum), plus half a unit of the
output's last place where it is BF16.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from recipes.fp8.blockwise import ACTIVATION_BLOCK, WEIGHT_BLOCK, quantize_blockwise  # noqa: E402
from recipes.fp8.block_gemm import block_scaled_gemm  # noqa: E402
from recipes.fp8.formats import E4M3  # noqa: E402
from recipes.fp8.gemm import fp8_gemm  # noqa: E402

from hopper_compile import run_compiled  # noqa: E402

K = 384
PAIRS = {  # the blockwise recipe's GEMMs: 1D2D's fprop and dgrad, 1D1D's (and every wgrad), x dim 2's fprop
    "1x128_x_128x128": (ACTIVATION_BLOCK, WEIGHT_BLOCK),
    "1x128_x_1x128": (ACTIVATION_BLOCK, ACTIVATION_BLOCK),
    "128x128_x_1x128": (WEIGHT_BLOCK, ACTIVATION_BLOCK),
}


def operand(rows: int, block: tuple[int, int], seed: int, hard: bool = True) -> torch.Tensor:
    """Random rows, with the hard blocks where `hard`: an all-zero 128-wide block, one scaled by 2**-20 and one by
    2**20."""
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(seed))
    if hard:
        x[: min(rows, 128), :128] = 0.0
        x[:, 128:256] *= 2.0**-20
        x[-min(rows, 128):, 256:] *= 2.0**20
    return quantize_blockwise(x, E4M3, block)


def shapes(a_block, b_block) -> tuple[int, int]:
    """Odd sizes where a 1x128 operand allows them; a 128x128 operand's rows are whole blocks."""
    return (200 if a_block == ACTIVATION_BLOCK else 256), (176 if b_block == ACTIVATION_BLOCK else 384)


def bound(a, b, out_dtype: torch.dtype, k: int = K) -> tuple[torch.Tensor, torch.Tensor]:
    """(the allowed error of each output, the FP64 product) of operands a and b, K = k."""
    magnitudes = a.dequantize().double().abs() @ b.dequantize().double().abs().t()
    exact = a.dequantize().double() @ b.dequantize().double().t()
    rounding = exact.abs() * 2.0**-8 if out_dtype == torch.bfloat16 else 0.0
    return 2.0**-24 * (128 + k / 128) * magnitudes + rounding, exact


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pair", PAIRS)
def test_each_block_pair_against_fp64(pair, out_dtype):
    a_block, b_block = PAIRS[pair]
    rows, cols = shapes(a_block, b_block)
    a, b = operand(rows, a_block, 1), operand(cols, b_block, 2)
    out = block_scaled_gemm(a, b, out_dtype)
    allowed, exact = bound(a, b, out_dtype)
    assert out.shape == (rows, cols) and out.dtype == out_dtype
    assert ((out.double() - exact).abs() <= allowed).all()
    assert exact.abs().max() > 1e6  # the huge blocks count
    # the product's own emulation of the same GEMM (dequantized operands in FP32) agrees within the same bound
    emulated = fp8_gemm(a, b, torch.float32, fast_accum=False, emulate=True).double()
    assert ((out.double() - emulated).abs() <= 2 * allowed).all()


def test_a_wrong_scale_is_far_outside_the_bound():
    """The bound can fail: the first K block of the weight's scales halved, or the input's scales read in the wrong
    order of K blocks."""
    a, b = operand(200, ACTIVATION_BLOCK, 1, hard=False), operand(384, WEIGHT_BLOCK, 2, hard=False)
    allowed, exact = bound(a, b, torch.float32)
    halved = b._replace(scale_inv=b.scale_inv * torch.tensor([[0.5, 1.0, 1.0]]))
    for wrong in (block_scaled_gemm(a, halved, torch.float32),
                  block_scaled_gemm(a._replace(scale_inv=a.scale_inv.flip(1)), b, torch.float32)):
        assert not ((wrong.double() - exact).abs() <= allowed).all()


def test_into_an_fp32_output_written_then_added():
    """A weight gradient's GEMM (1x128 x 1x128) into its FP32 main gradient: written in the first micro-batch,
    added in the others."""
    a, b = operand(200, ACTIVATION_BLOCK, 3), operand(176, ACTIVATION_BLOCK, 4)
    main_grad = torch.full((200, 176), float("nan"))
    block_scaled_gemm(a, b, out=main_grad)
    first = main_grad.clone()
    block_scaled_gemm(a, b, out=main_grad, accumulate=True)
    allowed, exact = bound(a, b, torch.float32)
    assert ((first.double() - exact).abs() <= allowed).all()
    assert ((main_grad.double() - 2 * exact).abs() <= 3 * allowed).all()
    with pytest.raises(ValueError, match="accumulating needs an FP32 output"):
        block_scaled_gemm(a, b, out=torch.zeros(200, 176, dtype=torch.bfloat16), accumulate=True)
    with pytest.raises(ValueError, match="a multiple of 128"):
        block_scaled_gemm(a._replace(data=a.data[:, :200]), b)


HOPPER_COMPILE = r"""
import sys
from pathlib import Path
from hopper_compile import compile_for_hopper
from recipes.fp8 import block_gemm

signature = {"a": "*fp8e4nv", "a_scale": "*fp32", "b": "*fp8e4nv", "b_scale": "*fp32", "out": "*bf16", "M": "i32",
             "N": "i32", "K": "i32"}
# every pair into BF16, and the weight gradient's pair added into FP32; launched with aligned pointers and K a
# multiple of 128 (M and N any size)
launches = [(a, b, "*bf16", False) for a, b in ((1, 128), (1, 1), (128, 1))] + [(1, 1, "*fp32", True)]
for a_rows, b_rows, out, accumulate in launches:
    for tile in block_gemm.tiles_for(block_gemm.TILES, {}, ACCUMULATE=accumulate):
        constants = dict(A_BLOCK_ROWS=a_rows, B_BLOCK_ROWS=b_rows, ACCUMULATE=accumulate, OUT_BF16=out == "*bf16",
                         SOFTWARE=False, **tile.kwargs)
        ptx, spilled, registers = compile_for_hopper(
            block_gemm._block_scaled_gemm_kernel, {**signature, "out": out}, constants, Path(sys.argv[1]),
            tile.num_warps, tile.num_stages, divisible=(0, 1, 2, 3, 4, 7))
        print(tile, a_rows, b_rows, out, "registers", registers, "spilled", spilled, flush=True)
        assert spilled == 0, f"{tile} {a_rows}x{b_rows} {out} spills {spilled} bytes"
        assert "wgmma.mma_async" in ptx and "cp.async" in ptx, "not Hopper's tensor cores fed asynchronously"
"""


def test_every_tile_compiles_for_hopper_to_tensor_core_code_without_spills(tmp_path):
    """Each autotuned tile of the kernel, for each block pair, compiled for sm_90a by Triton's own ptxas (no GPU
    needed): its FP8 products on Hopper's asynchronous tensor-core instructions (wgmma), its operands copied
    asynchronously, no register spilled (128 x 128 with 4 warps spilled ~480 bytes a thread and is not a tile)."""
    run_compiled(HOPPER_COMPILE, tmp_path)
