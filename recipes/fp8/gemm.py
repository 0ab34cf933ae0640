"""One FP8 GEMM, `a @ b^T` with a (M, K) and b (N, K) both row-major (K-major, the "TN" layout FP8 tensor cores
take), dispatched on the operands' scaling granularity:

- per-tensor scales: torch._scaled_mm (cuBLAS) on GPUs; on a CPU the FP8 values, exact in FP32, multiplied and
  summed in FP32 and then scaled, as cuBLAS applies the scales (PyTorch's own CPU _scaled_mm computes the same
  through a generic loop, 50-100x slower, which made every FP8 run on a CPU crawl);
- 1x128 / 128x128 blocks: torch.nn.functional.scaled_mm on Hopper (cuBLAS block scaling, CUDA >= 12.9);
- 1x32 MX blocks: torch.nn.functional.scaled_mm with E8M0 scales in the 32_4_4 layout on Blackwell;
- one scale per row (row-wise scaling): torch._scaled_mm's row-wise scales (sm89 and later), whose kernels write
  BF16 only: the result in BF16, then in the output's dtype (torchao's weight gradient is BF16 the same way);
- NVFP4 (E2M1 codes, E4M3 scales of 1x16 blocks, an FP32 scale per tensor; recipes.fp8.nvfp4):
  torch.nn.functional.scaled_mm's two-level NVFP4 scaling on Blackwell (cuBLAS's FP4 GEMM: the block scales
  swizzled in the 32_4_4 layout, a 16x16-block weight's scale repeated over its 16 rows, the tensor scales applied
  to the FP32 sums); emulated, each operand's values times its block scales (exact in BF16) multiplied on BF16
  tensor cores with FP32 sums, then the two tensor scales, as TE's reference GEMM applies its global scales (on a
  GPU inside one cuBLASLt GEMM that reads them from device memory and writes the output's type: recipes.fp8.cublaslt);
- emulated (only when the precision asks for it): the operands dequantized and multiplied with FP32 sums, the
  same numbers a native block-scaled GEMM computes up to the order of FP32 accumulation; on a GPU on BF16 tensor
  cores, in which an FP8 value times a power-of-two scale is exact (the 128x128 x 128x128 GEMMs of
  fp8_blockwise_2d2d, which no native kernel takes, ran ~10x slower on FP32 SIMT).

The block-scaled GEMMs, native and emulated, are opaque custom ops (`fp8_recipes::block_scaled_mm`, `::nvfp4_mm`) for
torch.compile: the op's argument checks and scale-layout fix-ups then stay out of the traced graph, so Dynamo never
breaks the graph inside an FP8 linear (a break there runs the whole autograd.Function, quantization included,
eagerly), and the emulation's FP8 -> FP32 decoding runs in ATen's kernels (the CPU's code), not in code Inductor
generates: a compiled emulated-MXFP8 model on an H200 computed other gradients than the eager one
(tests/test_gpu.py).

There is no silent fallback: a block-scaled GEMM without a native kernel and without emulation raises.

The weight-gradient GEMM can also write into, or add to, an FP32 main gradient (`fp8_gemm_into`; BF16:
recipes.compute.mm_into):
inside the GEMM on CUDA (cuBLASLt with beta = 1 for per-tensor FP8 and for 1x128 blocks, recipes.fp8.cublaslt;
cuBLAS's FP32-output BF16 GEMM), so that summing a weight's gradient over micro-batches costs no pass of its own;
elsewhere the GEMM's result is written or added in a second step, with the same numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from recipes.compute import mm_into
from recipes.fp8 import cublaslt
from recipes.fp8.blockwise import ACTIVATION_BLOCK, WEIGHT_BLOCK
from recipes.fp8.mxfp8 import MX_BLOCK, swizzle_32_4_4, to_e8m0
from recipes.fp8.nvfp4 import NVFP4_BLOCK
from recipes.fp8.tensor import ROW_BLOCK, Float8Tensor


def fp8_gemm(a: Float8Tensor, b: Float8Tensor, out_dtype: torch.dtype, fast_accum: bool, emulate: bool) -> torch.Tensor:
    if a.is_fp4:
        if not emulate and not _blackwell(a.data.device):
            raise RuntimeError(f"no native NVFP4 GEMM on {_device_name(a.data.device)} (FP4 tensor cores: Blackwell); "
                               "set precision.emulate=true to emulate it")
        return nvfp4_mm(a.data, a.scale_inv, a.tensor_scale_inv, a.block[0], b.data, b.scale_inv, b.tensor_scale_inv,
                        b.block[0], out_dtype, emulate)
    if a.block is None and b.block is None:
        return tensorwise_mm(a.data, b.data, a.scale_inv, b.scale_inv, out_dtype, fast_accum)
    if a.block == b.block == ROW_BLOCK and (a.data.is_cuda or emulate):
        result = rowwise_mm(a, b, fast_accum, emulate)
        # Not `.to(out_dtype)` when it is already BF16: under torch.compile (aot_eager too) that no-op left the FP8
        # linear's backward writing zeros as dgrad and wgrad on an H100 (tests/test_gpu.py, fp8_rowwise compiled).
        return result if result.dtype == out_dtype else result.to(out_dtype)
    if not emulate and not (a.data.is_cuda and (a.block != MX_BLOCK or _blackwell(a.data.device))):
        raise RuntimeError(
            f"no native {a.block} x {b.block} block-scaled FP8 GEMM on {_device_name(a.data.device)}"
            f"{' (MX scales: Blackwell)' if a.block == MX_BLOCK else ''}; set precision.emulate=true to emulate it"
        )
    return block_scaled_mm(a.data, a.scale_inv, list(a.block), b.data, b.scale_inv, list(b.block), out_dtype, emulate)


def _blackwell(device: torch.device) -> bool:
    """Whether `device` is a GPU with Blackwell's MX and NVFP4 GEMMs (compute capability 10 and later): elsewhere
    cuBLAS answers those with CUBLAS_STATUS_NOT_SUPPORTED, after the run has built its model."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)


def rowwise_mm(a: Float8Tensor, b: Float8Tensor, fast_accum: bool, emulate: bool) -> torch.Tensor:
    """a @ b^T in BF16 for operands with one scale per row: scale_a (M, 1) and scale_b (1, N) in the epilogue."""
    if emulate:
        return (a.dequantize() @ b.dequantize().t()).to(torch.bfloat16)
    return torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv.t(),
                            out_dtype=torch.bfloat16, use_fast_accum=fast_accum)


def tensorwise_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                  out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """scale_a * scale_b * (a @ b^T) for per-tensor FP8 operands, a (M, K) and b (N, K) row-major."""
    if a.is_cuda:
        return torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                                use_fast_accum=fast_accum)
    return ((a.float() @ b.float().t()) * (scale_a * scale_b)).to(out_dtype)


def fp8_gemm_into(a: Float8Tensor, b: Float8Tensor, out: torch.Tensor, accumulate: bool, emulate: bool) -> None:
    """out (FP32) = a @ b^T, or out += a @ b^T when `accumulate`: a weight gradient into its main gradient. Inside
    the GEMM for per-tensor and 1x128 x 1x128 operands; other block pairs (a 128x128 input or gradient) write an
    FP32 product that is then added."""
    if a.block is None and b.block is None:
        scaled_mm_into(a.data, b.data, a.scale_inv, b.scale_inv, out, accumulate)
    elif a.block == b.block == ACTIVATION_BLOCK and a.data.is_cuda and not emulate:
        block_scaled_mm_into(a.data, a.scale_inv, b.data, b.scale_inv, out, accumulate)
    else:
        _write_or_add(out, fp8_gemm(a, b, torch.float32, False, emulate), accumulate)


def _write_or_add(out: torch.Tensor, result: torch.Tensor, accumulate: bool) -> None:
    if accumulate:
        out.add_(result)
    else:
        out.copy_(result)


@torch.library.custom_op("fp8_recipes::scaled_mm_into", mutates_args=("out",))
def scaled_mm_into(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                   out: torch.Tensor, accumulate: bool) -> None:
    """Per-tensor FP8 `a @ b^T` (K-major both, no fast accumulation, as every wgrad) into FP32 `out`."""
    if cublaslt.supports(a, b, out):
        cublaslt.scaled_mm(a, b, scale_a, scale_b, out, accumulate)
    else:
        _write_or_add(out, tensorwise_mm(a, b, scale_a, scale_b, torch.float32), accumulate)


@torch.library.custom_op("fp8_recipes::block_scaled_mm_into", mutates_args=("out",))
def block_scaled_mm_into(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
                         out: torch.Tensor, accumulate: bool) -> None:
    """`a @ b^T` of two operands in 1x128 blocks (a weight gradient's) into FP32 `out`, on CUDA."""
    a_operand = Float8Tensor(a, a_scale_inv, ACTIVATION_BLOCK)
    b_operand = Float8Tensor(b, b_scale_inv, ACTIVATION_BLOCK)
    if cublaslt.supports(a, b, out):
        cublaslt.scaled_mm(a, b, _native_block_scale(a_operand), _native_block_scale(b_operand), out, accumulate,
                           scale_mode=cublaslt.SCALE_VEC128)
    else:
        _write_or_add(out, _blockwise_gemm(a_operand, b_operand, torch.float32), accumulate)


@torch.library.custom_op("fp8_recipes::block_scaled_mm", mutates_args=())
def block_scaled_mm(
    a: torch.Tensor, a_scale_inv: torch.Tensor, a_block: list[int],
    b: torch.Tensor, b_scale_inv: torch.Tensor, b_block: list[int],
    out_dtype: torch.dtype, emulate: bool,
) -> torch.Tensor:
    a_operand, b_operand = Float8Tensor(a, a_scale_inv, tuple(a_block)), Float8Tensor(b, b_scale_inv, tuple(b_block))
    if emulate:
        return _emulated_gemm(a_operand, b_operand, out_dtype)
    if a_operand.block == MX_BLOCK:
        return _mx_gemm(a_operand, b_operand, out_dtype)
    return _blockwise_gemm(a_operand, b_operand, out_dtype)


@block_scaled_mm.register_fake
def _(a, a_scale_inv, a_block, b, b_scale_inv, b_block, out_dtype, emulate):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def _emulated_gemm(a: Float8Tensor, b: Float8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The dequantized operands multiplied with FP32 sums: on a CPU in FP32; on a GPU on BF16 tensor cores with FP32
    sums (_bf16_product), as NVFP4's emulation, several times faster than FP32 (SIMT) or TF32. Each value is an FP8
    value times a power-of-two scale (pow2_scaled_bf16), exact in BF16, so both compute the native kernel's numbers
    up to the order of the FP32 sums."""
    if not a.data.is_cuda:
        return (a.dequantize() @ b.dequantize().t()).to(out_dtype)
    return _bf16_product(pow2_scaled_bf16(a), pow2_scaled_bf16(b), None, out_dtype)


def _bf16_product(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """scale * a @ b^T (scale None: 1) of exact BF16 operands with FP32 sums, rounded once to out_dtype: on CUDA one
    cuBLASLt GEMM that reads `scale` from device memory and writes out_dtype (cublaslt.bf16_mm); elsewhere the FP32
    product (mm_into), then scaled and cast: the same numbers in two more passes over the output."""
    out = a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)
    if cublaslt.supports_bf16(a, b, out):
        cublaslt.bf16_mm(a, b, out, scale)
        return out
    product = a.new_empty((a.shape[0], b.shape[0]), dtype=torch.float32)
    mm_into(a, b, product, accumulate=False)
    product = product if scale is None else product * scale
    return product if out_dtype == torch.float32 else product.to(out_dtype)


def pow2_scaled_bf16(operand: Float8Tensor) -> torch.Tensor:
    """A block-scaled FP8 operand's values times their scales, in BF16. Exact where the scales are powers of two, as
    every block-scaled recipe here makes them (blockwise: TE's power-of-two rounding, recipes.fp8.blockwise; MX:
    E8M0): an FP8 value has at most 4 significant bits and BF16 keeps 8 and FP32's exponent range, subnormals down to
    2**-133 (a smaller value, from a block whose amax is below ~2**-124, would be rounded). FP8 to BF16 and the
    product by a power of two are exact, so no FP32 copy is made."""
    (block_rows, block_cols), (rows, cols) = operand.block, operand.data.shape
    blocks = operand.data.to(torch.bfloat16).view(rows // block_rows, block_rows, cols // block_cols, block_cols)
    return (blocks * operand.scale_inv.to(torch.bfloat16)[:, None, :, None]).view(rows, cols)


@torch.library.custom_op("fp8_recipes::nvfp4_mm", mutates_args=())
def nvfp4_mm(
    a: torch.Tensor, a_scale_inv: torch.Tensor, a_tensor_scale_inv: torch.Tensor, a_block_rows: int,
    b: torch.Tensor, b_scale_inv: torch.Tensor, b_tensor_scale_inv: torch.Tensor, b_block_rows: int,
    out_dtype: torch.dtype, emulate: bool,
) -> torch.Tensor:
    """`a @ b^T` of two NVFP4 operands (recipes.fp8.tensor's layout: packed codes, E4M3 block scales of
    `*_block_rows` x 16, the tensor's decode scale)."""
    a_operand = Float8Tensor(a, a_scale_inv, (a_block_rows, NVFP4_BLOCK[1]), a_tensor_scale_inv)
    b_operand = Float8Tensor(b, b_scale_inv, (b_block_rows, NVFP4_BLOCK[1]), b_tensor_scale_inv)
    if emulate:
        return emulated_nvfp4_gemm(a_operand, b_operand, out_dtype)
    return native_nvfp4_gemm(a_operand, b_operand, out_dtype)


@nvfp4_mm.register_fake
def _(a, a_scale_inv, a_tensor_scale_inv, a_block_rows, b, b_scale_inv, b_tensor_scale_inv, b_block_rows,
      out_dtype, emulate):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def emulated_nvfp4_gemm(a: Float8Tensor, b: Float8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Each operand's values times their block scales, exact in BF16, multiplied with FP32 sums (tensor cores on a
    GPU), the sums times the two tensor scales (inside the GEMM on a GPU: _bf16_product)."""
    return _bf16_product(_exact_bf16(a), _exact_bf16(b), a.tensor_scale_inv * b.tensor_scale_inv, out_dtype)


def _exact_bf16(operand: Float8Tensor) -> torch.Tensor:
    """An NVFP4 operand's values times their block scales, exact in BF16; on CUDA in one Triton kernel
    (recipes.fp8.nvfp4_kernels) instead of PyTorch's unpacking and table lookup."""
    if operand.data.is_cuda:
        from recipes.fp8 import nvfp4_kernels

        return nvfp4_kernels.block_scaled_bf16(operand.data, operand.scale_inv, operand.block[0])
    return operand.block_scaled().bfloat16()


def native_nvfp4_gemm(a: Float8Tensor, b: Float8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """cuBLAS's NVFP4 GEMM through PyTorch's two-level NVFP4 scaling (Blackwell): E2M1 operands, their E4M3 block
    scales swizzled, the tensor scales applied to the FP32 sums. Not run on this project's machines yet (no
    Blackwell); its arguments pass PyTorch's own checks on the meta device (nvfp4_gemm_available)."""
    scaling = [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise]
    swizzle = [F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE]
    return F.scaled_mm(
        a.data.view(torch.float4_e2m1fn_x2), b.data.view(torch.float4_e2m1fn_x2).t(),
        [native_nvfp4_scale(a), a.tensor_scale_inv], scaling,
        [native_nvfp4_scale(b), b.tensor_scale_inv], scaling,
        swizzle_a=swizzle, swizzle_b=swizzle, output_dtype=out_dtype,
    )


def nvfp4_gemm_available() -> bool:
    """Whether this PyTorch takes native_nvfp4_gemm's arguments (float4_e2m1fn_x2, scaled_mm's two-level NVFP4
    scaling), asked of its own shape and type checks on the meta device: no GPU needed."""
    operand = Float8Tensor(torch.empty(128, 32, dtype=torch.uint8, device="meta"),
                           torch.empty(128, 4, dtype=torch.float8_e4m3fn, device="meta"), NVFP4_BLOCK,
                           torch.empty((), device="meta"))
    try:
        native_nvfp4_gemm(operand, operand, torch.bfloat16)
    except (AttributeError, NotImplementedError, RuntimeError, TypeError):
        return False
    return True


def native_nvfp4_scale(operand: Float8Tensor) -> torch.Tensor:
    """The E4M3 block scales as cuBLAS's NVFP4 GEMM reads them: one per 16 elements of each row (a 16x16 block's
    scale repeated over its 16 rows), swizzled (the 32_4_4 layout, in bytes), flat."""
    scale = operand.scale_inv.view(torch.uint8).repeat_interleave(operand.block[0], dim=0)
    return swizzle_32_4_4(scale).flatten().view(torch.float8_e4m3fn)


def _blockwise_gemm(a: Float8Tensor, b: Float8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """cuBLAS block scaling on sm90, E4M3 operands only: a and b each in 1x128 or 128x128 blocks, never both
    128x128 (PyTorch's 1x128 x 128x128, 128x128 x 1x128 and 1x128 x 1x128; recipes.config.gemms_of_two_2d_operands
    refuses the other before a run). Scales are outer-dim-major (column-major) for a 1x128 operand; a 128x128
    operand's scale grid is K-block-major with rows padded to a multiple of 4 (tests/test_gpu.py checks each pair
    against the emulation)."""
    recipe = {ACTIVATION_BLOCK: F.ScalingType.BlockWise1x128, WEIGHT_BLOCK: F.ScalingType.BlockWise128x128}
    return F.scaled_mm(
        a.data, b.data.t(),
        _native_block_scale(a), recipe[a.block],
        _native_block_scale(b), recipe[b.block],
        output_dtype=out_dtype,
    )


def _native_block_scale(operand: Float8Tensor) -> torch.Tensor:
    scale = operand.scale_inv
    if operand.block == ACTIVATION_BLOCK:
        return scale.t().contiguous().t()  # (rows, K/128), stride (1, rows)
    padded = F.pad(scale, (0, -scale.shape[1] % 4))  # (N/128, L4), L4 = K/128 rounded up to 4
    return padded.t()  # (L4, N/128), stride (1, L4)


def _mx_gemm(a: Float8Tensor, b: Float8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Blackwell (sm100) MXFP8: E8M0 scales, swizzled. Not run on this project's machines yet (no Blackwell)."""
    return F.scaled_mm(
        a.data, b.data.t(),
        _native_mx_scale(a), F.ScalingType.BlockWise1x32,
        _native_mx_scale(b), F.ScalingType.BlockWise1x32,
        swizzle_a=F.SwizzleType.SWIZZLE_32_4_4, swizzle_b=F.SwizzleType.SWIZZLE_32_4_4,
        output_dtype=out_dtype,
    )


def _native_mx_scale(operand: Float8Tensor) -> torch.Tensor:
    return swizzle_32_4_4(to_e8m0(operand.scale_inv)).flatten().view(torch.float8_e8m0fnu)
