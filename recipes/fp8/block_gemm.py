"""A block-scaled FP8 GEMM of our own in Triton (issue 49's first candidate against cuBLAS's): `a @ b^T` for
operands in 1x128 or 128x128 blocks (recipes.fp8.blockwise's layout: E4M3 values (rows, K), FP32 decode scales
(rows / block rows, K / 128)), every pair the blockwise recipe trains with.

Each program computes a BLOCK_M x BLOCK_N tile of the output. K runs in steps of 128, one scale block: the step's
FP8 product is formed on the tensor cores into a fresh FP32 accumulator, then multiplied by the two operands'
scales of that step and added to the tile's FP32 sum. That is the "promotion" every 128 of K that DeepGEMM and
cuBLAS's block scaling do: the tensor cores' own FP8 accumulation (fewer than FP32's bits on Hopper) never sums
more than 128 products. The result is written in BF16 or FP32, or added to an FP32 output (a weight gradient
into its main gradient).

Not in the training path yet: scripts/gemm_bench.py times it beside cuBLAS's GEMMs of the same operands
(`triton_*` variants), and tests/test_block_gemm.py checks it against an FP64 reference in Triton's CPU
interpreter (tests/test_gpu.py on a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from recipes.fp8.fused_quantize import _bf16, _store_bf16
from recipes.fp8.kernels import INTERPRETED
from recipes.fp8.tensor import Float8Tensor

SCALE_BLOCK = 128  # the blockwise recipe's blocks: K steps of 128, 128 rows of a 128x128 operand


@triton.jit
def _block_scaled_gemm_kernel(a, a_scale, b, b_scale, out, M, N, K, A_BLOCK_ROWS: tl.constexpr,
                              B_BLOCK_ROWS: tl.constexpr, ACCUMULATE: tl.constexpr, OUT_BF16: tl.constexpr,
                              SOFTWARE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              GROUP_M: tl.constexpr):
    BLOCK_K: tl.constexpr = 128
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)  # GROUP_M row tiles walk the column tiles together (L2 reuse of b)
    first_m = group * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % rows_in_group
    pid_n = (pid % (GROUP_M * tiles_n)) // rows_in_group
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    m_in, n_in = m < M, n < N
    m_safe, n_safe = tl.where(m_in, m, 0), tl.where(n_in, n, 0)  # rows past the end read row 0: never stored
    k_blocks = K // BLOCK_K
    a_rows = a + m_safe[:, None] * K + kk[None, :]  # 32-bit offsets (block_scaled_gemm checks they fit)
    b_rows = b + n_safe[:, None] * K + kk[None, :]
    # A 128x128-block operand has one scale per K step in a tile (its tiles are at most 128 wide and aligned):
    # a scalar, not a vector the registers must hold per row or column.
    if A_BLOCK_ROWS == 1:
        a_scales = a_scale + m_safe * k_blocks
    else:
        a_scales = a_scale + ((pid_m * BLOCK_M) // A_BLOCK_ROWS) * k_blocks
    if B_BLOCK_ROWS == 1:
        b_scales = b_scale + n_safe * k_blocks
    else:
        b_scales = b_scale + ((pid_n * BLOCK_N) // B_BLOCK_ROWS) * k_blocks
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, k_blocks):
        partial = tl.dot(tl.load(a_rows), tl.trans(tl.load(b_rows)))
        a_rows += BLOCK_K
        b_rows += BLOCK_K
        sa = tl.load(a_scales + step)
        sb = tl.load(b_scales + step)
        if A_BLOCK_ROWS == 1:
            sa = sa[:, None]
        if B_BLOCK_ROWS == 1:
            sb = sb[None, :]
        acc += partial * sa * sb
    pointers = out + m[:, None] * N + n[None, :]
    mask = m_in[:, None] & n_in[None, :]
    if ACCUMULATE:
        acc += tl.load(pointers, mask=mask, other=0.0)
    if OUT_BF16:  # rounded to nearest even (the interpreter's own conversion truncates: fused_quantize._bf16)
        _store_bf16(pointers, _bf16(acc, SOFTWARE), mask, SOFTWARE)
    else:
        tl.store(pointers, acc, mask=mask)


# Tiles timed per shape on GPUs (triton.autotune; the interpreter runs one small tile), at most 128 wide (a
# 128x128-block operand's scale is then one per tile and K step), none spilling registers when compiled for sm_90a
# (tests/test_block_gemm.py: 128 x 128 with 4 warps spilled ~480 bytes a thread).
TILES = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 8}, num_warps=w, num_stages=s)
         for bm, bn, w, s in ((128, 128, 8, 4), (128, 128, 8, 3), (128, 64, 8, 4), (64, 128, 8, 4), (64, 128, 4, 4),
                              (128, 64, 4, 4), (64, 64, 4, 4))]
SPILLING_WHEN_ADDING = {(128, 128, 8), (128, 64, 4)}  # (BLOCK_M, BLOCK_N, warps): 12 and 152 bytes into FP32 `out`


def tiles_for(configs: list, named_args: dict, **kwargs) -> list:
    """The tiles the autotuner tries for a launch: those that do not spill in it."""
    return [c for c in configs if not kwargs["ACCUMULATE"]
            or (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps) not in SPILLING_WHEN_ADDING]


_KERNEL = (_block_scaled_gemm_kernel if INTERPRETED
           else triton.autotune(TILES, key=["M", "N", "K", "A_BLOCK_ROWS", "B_BLOCK_ROWS", "ACCUMULATE", "OUT_BF16"],
                                prune_configs_by={"early_config_prune": tiles_for},
                                restore_value=["out"])(_block_scaled_gemm_kernel))  # timing runs add to `out` too


def block_scaled_gemm(a: Float8Tensor, b: Float8Tensor, out_dtype: torch.dtype = torch.bfloat16,
                      out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """a @ b^T of two operands in 1x128 or 128x128 blocks, a (M, K) and b (N, K), K a multiple of 128: a new
    (M, N) tensor in `out_dtype`, or written into FP32 `out` (added to it with `accumulate`)."""
    (rows, k), n = a.data.shape, b.data.shape[0]
    if k % SCALE_BLOCK or b.data.shape[1] != k:
        raise ValueError(f"block-scaled GEMM needs one K, a multiple of {SCALE_BLOCK}: {tuple(a.data.shape)} x "
                         f"{tuple(b.data.shape)}")
    if max(rows * k, n * k, rows * n) >= 2**31:
        raise ValueError(f"block-scaled GEMM of {tuple(a.data.shape)} x {tuple(b.data.shape)}: its kernel's 32-bit "
                         "offsets address at most 2**31 elements of an operand or the output")
    if out is None:
        out = torch.empty((rows, n), dtype=out_dtype, device=a.data.device)
    elif accumulate and out.dtype != torch.float32:
        raise ValueError(f"accumulating needs an FP32 output, got {out.dtype}")
    arguments = (a.data, a.scale_inv.contiguous(), b.data, b.scale_inv.contiguous())
    grid = lambda meta: (triton.cdiv(rows, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    tile = {"BLOCK_M": 32, "BLOCK_N": 32, "GROUP_M": 2} if INTERPRETED else {}
    bf16 = out.dtype == torch.bfloat16
    _KERNEL[grid](*arguments, out.view(torch.int16) if bf16 and INTERPRETED else out, rows, n, k,
                  A_BLOCK_ROWS=a.block[0], B_BLOCK_ROWS=b.block[0], ACCUMULATE=accumulate, OUT_BF16=bf16,
                  SOFTWARE=INTERPRETED, **tile)
    return out
