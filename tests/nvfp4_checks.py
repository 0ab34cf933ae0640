"""The adversarial tensors of NVFP4's tests and the checks of its Triton kernels (recipes.fp8.nvfp4_kernels: the
quantizer, the Hadamard transform, the decoder of the emulated GEMM's inputs), shared by the CPU suite (Triton's
interpreter, tests/test_nvfp4.py) and the GPU suite (tests/test_gpu.py): on either device each kernel's output equals
the CPU reference's (recipes.fp8.nvfp4, itself held to an independent rewrite of Transformer Engine's reference in
tests/test_nvfp4.py) bit for bit, on the same adversarial set: every tie of the E2M1 table, zero and subnormal block
scales, inf, NaN, partial tiles."""

from __future__ import annotations

import torch

from recipes.fp8.nvfp4 import RHT_SIGNS, hadamard_matrix, quantize_nvfp4, random_hadamard_transform, uniform


def adversarial(dtype: torch.dtype) -> torch.Tensor:
    """32 x 64 (1x16 and 16x16 blocks): the global amax 2688 (S_enc = 1 exactly) sits in row 0, so blocks of amax
    6 * 2**j get the E4M3 scale 2**j and the exact encode 2**-j: rows 1-3 put values on every tie of the E2M1 table
    (and just beside it); an all-zero block and row; blocks whose scale is E4M3-subnormal or flushes to zero; blocks
    spanning 2**-20..2**9; negative values that round to zero."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=g, dtype=torch.float64)
    x[0, 0] = 2688.0
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0],
                        dtype=torch.float64)
    for row, j in ((1, 0), (2, 3), (3, -4)):
        x[row, :16] = ties * 2.0**j
        x[row, 16:32] = ties * 2.0**j * (1 + 2.0**-7)  # just above each tie (in BF16 too)
        x[row, 32:48] = ties * 2.0**j * (1 - 2.0**-7)
    x[4] = 0.0  # an all-zero row
    x[5, :16] = torch.randn(16, generator=g, dtype=torch.float64) * 2.0**-7  # E4M3-subnormal block scale
    x[5, 16:32] = torch.randn(16, generator=g, dtype=torch.float64) * 2.0**-30  # block scale flushes to zero
    x[6] = torch.randn(64, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-20, 10, (64,), generator=g))
    x[7, :16] = -torch.rand(16, generator=g, dtype=torch.float64) * 0.02  # negative, below the smallest E2M1 step
    x[16:32, 48:] = 0.0  # an all-zero 16x16 block
    x[16:32, 32:48] *= 2.0**-6  # a 16x16 block with an E4M3-subnormal scale
    return x.to(dtype)



def kernel_cases():
    """(name, tensor): the adversarial tensors in both dtypes, with an inf and a NaN, and shapes whose rows and
    columns leave a program's 16 x 64 tile partly empty."""
    g = torch.Generator().manual_seed(4)
    cases = [(f"adversarial-{str(dtype)[6:]}", adversarial(dtype)) for dtype in (torch.bfloat16, torch.float32)]
    for special in ("inf", "nan"):
        x = adversarial(torch.float32)
        x[9, 5], x[20, 40] = float(special), -float(special)
        cases.append((special, x))
    cases += [(f"{rows}x{cols}", torch.randn(rows, cols, generator=g).bfloat16()) for rows, cols in ((48, 80), (16, 208))]
    cases.append(("8x48", torch.randn(8, 48, generator=g) * 1e-3))  # 1x16 blocks only
    return cases


def same_e4m3(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same E4M3 bytes, NaN's sign bit aside (the kernel's NaN scales are 0x7F, the CPU's from NaN inputs 0xFF)."""
    a, b = a.view(torch.uint8), b.view(torch.uint8)
    nan_a, nan_b = (a & 0x7F) == 0x7F, (b & 0x7F) == 0x7F
    return torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b])



def check_kernel_bytes(device: str, tile_rows: int, stochastic: bool, hadamard: bool) -> None:
    """The quantizer kernel on `device` against quantize_nvfp4 on the CPU, byte for byte: codes, E4M3 scales,
    decode scale; stochastic rounding from the same seed and operand; of the random Hadamard transform (the weight
    gradient's operands), the kernel's against random_hadamard_transform's."""
    from recipes.fp8.nvfp4_kernels import quantize

    seed = torch.tensor([1234, 5, 17]) if stochastic else None
    device_seed = None if seed is None else seed.to(device)
    for name, x in kernel_cases():
        if x.shape[0] % tile_rows:
            continue
        codes, scales, decode = (t.cpu() for t in quantize(x.to(device), tile_rows, device_seed, 1,
                                                            RHT_SIGNS if hadamard else None))
        source = random_hadamard_transform(x) if hadamard else x
        expected = quantize_nvfp4(source, (tile_rows, 16), uniform(seed, 1, x.shape) if stochastic else None)
        expected = expected.as_operand()
        assert torch.equal(codes, expected.data), name
        assert same_e4m3(scales, expected.scale_inv), name
        assert torch.equal(decode, expected.tensor_scale_inv) or (decode.isnan() and expected.tensor_scale_inv.isnan())
    if stochastic:  # another operand draws other numbers
        x = adversarial(torch.bfloat16).to(device)
        assert not torch.equal(quantize(x, tile_rows, device_seed, 0)[0], quantize(x, tile_rows, device_seed, 1)[0])


def check_hadamard_kernel(device: str) -> None:
    """The Hadamard kernel on `device` against random_hadamard_transform on the CPU (float64, then PyTorch's cast):
    the same bits in BF16 and FP32, NaN where it is NaN, inf, values spanning 2**-20..2**9 in one block, odd shapes;
    its amax is torch.amax of the result. Other signs give other values, and a BF16 result is rounded through FP32,
    as PyTorch casts float64 (one value whose direct rounding would differ)."""
    from recipes.fp8.nvfp4_kernels import hadamard_transform

    tie = torch.zeros(1, 16, dtype=torch.bfloat16)
    tie[0, :3] = torch.tensor([4.0, 2.0**-6, 2.0**-28])  # the first output 1 + 2**-8 + 2**-30 before rounding
    for name, x in kernel_cases() + [("tie", tie)]:
        got, amax = (t.cpu() for t in hadamard_transform(x.to(device), RHT_SIGNS))
        expected = random_hadamard_transform(x)
        assert got.dtype == x.dtype and torch.equal(got.isnan(), expected.isnan()), name
        assert torch.equal(got[~got.isnan()], expected[~expected.isnan()]), name
        reference_amax = expected.float().abs().amax()
        assert torch.equal(amax, reference_amax) or (amax.isnan() and reference_amax.isnan()), name
    x = adversarial(torch.bfloat16)
    assert not torch.equal(hadamard_transform(x.to(device), (1,) * 16)[0].cpu(), random_hadamard_transform(x))
    # just above BF16's tie between 1 and 1 + 2**-7: rounded directly it would be 1 + 2**-7; through FP32 (1 + 2**-8,
    # the tie itself) it is 1, ties to even
    assert (tie.double() @ hadamard_matrix())[0, 0].item() == 1 + 2.0**-8 + 2.0**-30
    assert hadamard_transform(tie.to(device), RHT_SIGNS)[0][0, 0].item() == 1.0


def check_decode_kernel(device: str) -> None:
    """The decoder on `device` (the emulated GEMM's input) equals Float8Tensor's block_scaled() on the CPU in BF16,
    bit for bit (NaN blocks as NaN), both block shapes."""
    from recipes.fp8.nvfp4_kernels import block_scaled_bf16

    for name, x in kernel_cases():
        for tile_rows in (1, 16):
            if x.shape[0] % tile_rows:
                continue
            operand = quantize_nvfp4(x, (tile_rows, 16)).as_operand()
            got = block_scaled_bf16(operand.data.to(device), operand.scale_inv.to(device), tile_rows).cpu()
            expected = operand.block_scaled()
            assert got.dtype == torch.bfloat16 and torch.equal(got.isnan(), expected.isnan()), name
            assert torch.equal(got[~got.isnan()].float(), expected[~expected.isnan()]), name


def check_reference_quantizer(device: str, tile_rows: int) -> None:
    """quantize_nvfp4 itself (the quantizer of precision.fused_kernels=false) on `device` writes the CPU's bytes,
    with and without the Hadamard transform and stochastic rounding (its random numbers drawn on `device`)."""
    seed = torch.tensor([1, 2, 3])
    device_seed = seed.to(device)
    for name, x in kernel_cases():
        if x.shape[0] % tile_rows:
            continue
        for hadamard in (False, True):
            source = random_hadamard_transform(x) if hadamard else x
            on_device = random_hadamard_transform(x.to(device)) if hadamard else x.to(device)
            for stochastic in (False, True):
                cpu = quantize_nvfp4(source, (tile_rows, 16), uniform(seed, 0, x.shape) if stochastic else None)
                got = quantize_nvfp4(on_device, (tile_rows, 16),
                                     uniform(device_seed, 0, x.shape) if stochastic else None)
                case = (name, hadamard, stochastic)
                assert torch.equal(cpu.codes, got.codes.cpu()), case
                assert same_e4m3(cpu.block_scale, got.block_scale.cpu()), case
                assert torch.equal(cpu.amax, got.amax.cpu()) or (cpu.amax.isnan() and got.amax.isnan().cpu()), case
