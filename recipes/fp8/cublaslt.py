"""FP8 GEMM that accumulates into an FP32 output, and the emulated GEMMs' BF16 GEMM with a scale read from device
memory, through cuBLASLt's C API (ctypes; nothing to build).

    out = scale_a * scale_b * (a @ b^T)            (accumulate=False)
    out = scale_a * scale_b * (a @ b^T) + out      (accumulate=True: beta = 1, inside the GEMM)

The scales are per tensor (FP32 0-d tensors) or, with scale_mode=SCALE_VEC128, one per 1x128 block of each
operand's rows (cuBLAS block scaling on Hopper, the layout torch.nn.functional.scaled_mm takes for BlockWise1x128:
(rows, K / 128) with the rows contiguous).

`torch._scaled_mm` and `torch.nn.functional.scaled_mm` have no beta, so a weight gradient summed over micro-batches
would cost an extra pass over the FP32 gradient per micro-batch (read the GEMM's output and the gradient, write the
gradient); Transformer Engine avoids it the same way as here (transformer_engine/common/gemm/cublaslt_gemm.cu:
C = D = main_grad, beta = 1).
a (M, K) and b (N, K) are row-major FP8 ("TN": K-major both), out (M, N) row-major FP32. Row-major out =
(b @ a^T) column-major, so cuBLAS computes it with A := b (transposed) and B := a.

The emulated block-scaled and NVFP4 GEMMs multiply exact BF16 operands (recipes.fp8.gemm): `bf16_mm` writes
alpha * a @ b^T in BF16 or FP32 with alpha an FP32 tensor on the GPU (POINTER_MODE_DEVICE: NVFP4's two tensor scales,
applied to the FP32 sums as cuBLAS's NVFP4 GEMM applies them, without a host synchronization) and split-K's partial
sums kept in FP32 (never in the BF16 output): one pass over the output where an FP32 product, its scaling and its
cast took three.

Enum values are those of cublasLt.h / library_types.h (CUDA 12 and 13 agree on every one used here).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
from typing import Optional

import torch

CUDA_R_32F, CUDA_R_16BF, CUDA_R_8F_E4M3, CUDA_R_8F_E5M2 = 0, 14, 28, 29
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
DESC_POINTER_MODE, DESC_TRANSA, DESC_TRANSB = 2, 3, 4
DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER, DESC_FAST_ACCUM = 17, 18, 25
DESC_A_SCALE_MODE, DESC_B_SCALE_MODE = 31, 32
POINTER_MODE_DEVICE = 1  # alpha and beta read from device memory
SCALE_SCALAR, SCALE_VEC128 = 0, 4  # cublasLtMatmulMatrixScale_t: per tensor; per 1x128 block (FP32)
PREF_MAX_WORKSPACE_BYTES, PREF_REDUCTION_SCHEME_MASK = 1, 3
REDUCTION_SCHEME_COMPUTE_TYPE = 2  # split-K's partial sums in the compute type, FP32 (no split-K is always allowed)
WORKSPACE_BYTES = 32 * 2**20  # what cuBLAS recommends for Hopper
_FP8_TYPES = {torch.float8_e4m3fn: CUDA_R_8F_E4M3, torch.float8_e5m2: CUDA_R_8F_E5M2}
_OUT_TYPES = {torch.float32: CUDA_R_32F, torch.bfloat16: CUDA_R_16BF}


class HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t."""

    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class CublasLtError(RuntimeError):
    pass


@functools.cache
def library() -> Optional[ctypes.CDLL]:
    """libcublasLt of the CUDA that torch was built with (the one torch itself loads); None without CUDA."""
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return None
    major = torch.version.cuda.split(".")[0]
    candidates = [f"libcublasLt.so.{major}"]
    for site in {os.path.dirname(os.path.dirname(torch.__file__))}:  # pip's nvidia-cublas wheels
        candidates += sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", f"libcublasLt.so.{major}")))
        candidates += sorted(glob.glob(os.path.join(site, "nvidia", "cublas", "lib", f"libcublasLt.so.{major}")))
    for name in candidates:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        _declare(lib)
        return lib
    return None


def _declare(lib: ctypes.CDLL) -> None:
    """Argument types of the calls used (size_t and 64-bit integers must not travel as C ints)."""
    ptr, i32, size = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    lib.cublasLtCreate.argtypes = [ptr]
    lib.cublasLtMatmulDescCreate.argtypes = [ptr, i32, i32]
    lib.cublasLtMatmulDescSetAttribute.argtypes = [ptr, i32, ptr, size]
    lib.cublasLtMatrixLayoutCreate.argtypes = [ptr, i32, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64]
    lib.cublasLtMatmulPreferenceCreate.argtypes = [ptr]
    lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [ptr, i32, ptr, size]
    lib.cublasLtMatmulPreferenceDestroy.argtypes = [ptr]
    lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [ptr] * 7 + [i32, ptr, ptr]
    lib.cublasLtMatmul.argtypes = [ptr] * 14 + [size, ptr]


def available() -> bool:
    return library() is not None


def _check(status: int, call: str) -> None:
    if status != 0:
        raise CublasLtError(f"{call} failed with cublasStatus_t {status}")


def _set(setter, obj, attribute: int, value) -> None:
    _check(setter(obj, attribute, ctypes.byref(value), ctypes.sizeof(value)), setter.__name__)


@functools.cache
def _handle(device: int) -> ctypes.c_void_p:
    handle = ctypes.c_void_p()
    _check(library().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    return handle


@functools.cache
def _workspace(device: int) -> torch.Tensor:
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=torch.device("cuda", device))


class _Plan:
    """The descriptors and algorithm of one GEMM shape and type combination, made once and reused. `fp8`: an FP8
    GEMM's (fast_accum, scale_mode, scale pointers); None: a BF16 GEMM with alpha and beta in device memory and
    split-K's sums in FP32."""

    def __init__(self, m: int, n: int, k: int, a_type: int, b_type: int, out_type: int, device: int,
                 fp8: Optional[tuple[bool, int, tuple[int, int]]] = None):
        lib = library()
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "DescCreate")
        set_desc = lib.cublasLtMatmulDescSetAttribute
        _set(set_desc, self.desc, DESC_TRANSA, ctypes.c_int32(CUBLAS_OP_T))
        _set(set_desc, self.desc, DESC_TRANSB, ctypes.c_int32(CUBLAS_OP_N))
        if fp8 is None:
            _set(set_desc, self.desc, DESC_POINTER_MODE, ctypes.c_int32(POINTER_MODE_DEVICE))
        else:
            fast_accum, scale_mode, scale_pointers = fp8
            _set(set_desc, self.desc, DESC_FAST_ACCUM, ctypes.c_int8(int(fast_accum)))
            for attribute in (DESC_A_SCALE_MODE, DESC_B_SCALE_MODE):
                _set(set_desc, self.desc, attribute, ctypes.c_int32(scale_mode))
            self.set_scales(*scale_pointers)  # before the heuristic, which must see an FP8-scaled GEMM
        # cuBLAS's m x n output is our (M, N) output transposed: cuBLAS A := b (N, K), cuBLAS B := a (M, K).
        self.layouts = []
        for dtype, rows, cols, ld in ((b_type, k, n, k), (a_type, k, m, k), (out_type, n, m, n), (out_type, n, m, n)):
            layout = ctypes.c_void_p()
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, ld), "MatrixLayoutCreate")
            self.layouts.append(layout)
        preference = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)), "PreferenceCreate")
        set_preference = lib.cublasLtMatmulPreferenceSetAttribute
        _set(set_preference, preference, PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(WORKSPACE_BYTES))
        if fp8 is None:
            _set(set_preference, preference, PREF_REDUCTION_SCHEME_MASK, ctypes.c_uint32(REDUCTION_SCHEME_COMPUTE_TYPE))
        self.heuristic, found = HeuristicResult(), ctypes.c_int(0)
        a_desc, b_desc, c_desc, d_desc = self.layouts
        _check(lib.cublasLtMatmulAlgoGetHeuristic(_handle(device), self.desc, a_desc, b_desc, c_desc, d_desc, preference,
                                                  1, ctypes.byref(self.heuristic), ctypes.byref(found)),
               "AlgoGetHeuristic")
        lib.cublasLtMatmulPreferenceDestroy(preference)
        if found.value == 0:
            raise CublasLtError(f"cuBLASLt has no algorithm for an ({n} x {k}) x ({k} x {m}) GEMM of types {a_type}, "
                                f"{b_type} into {out_type}" + (f", scale mode {fp8[1]}" if fp8 else ""))

    def set_scales(self, a_scale: int, b_scale: int) -> None:
        """Device pointers of the FP32 scales of cuBLAS's A and B (our b and a)."""
        set_desc = library().cublasLtMatmulDescSetAttribute
        _set(set_desc, self.desc, DESC_A_SCALE_POINTER, ctypes.c_void_p(a_scale))
        _set(set_desc, self.desc, DESC_B_SCALE_POINTER, ctypes.c_void_p(b_scale))


_PLANS: dict[tuple, _Plan] = {}
ALIGNMENT = 256  # cuBLASLt's default assumption about every buffer (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES)


def supports(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether scaled_mm can take these buffers: cuBLASLt loaded, row-major, aligned as its algorithms assume."""
    return _takes(a, b, out) and a.dtype in _FP8_TYPES and b.dtype in _FP8_TYPES and out.dtype == torch.float32


def _takes(*tensors: torch.Tensor) -> bool:
    """cuBLASLt loaded, and the buffers on the GPU, row-major, aligned as its algorithms assume."""
    return available() and all(t.is_cuda and t.is_contiguous() and t.data_ptr() % ALIGNMENT == 0 for t in tensors)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out: torch.Tensor,
              accumulate: bool, fast_accum: bool = False, scale_mode: int = SCALE_SCALAR) -> None:
    """out (FP32, M x N) = scale_a * scale_b * a @ b^T (+ out when accumulate), on the current CUDA stream.
    The caller checks `supports` first."""
    (m, k), (n, k_b) = a.shape, b.shape
    if out.shape != (m, n) or k_b != k:
        raise ValueError(f"cublaslt.scaled_mm: a {tuple(a.shape)}, b {tuple(b.shape)}, out {tuple(out.shape)}")
    device = out.device.index
    key = (m, n, k, a.dtype, b.dtype, fast_accum, scale_mode, device)
    scales = (scale_b.data_ptr(), scale_a.data_ptr())
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _Plan(m, n, k, _FP8_TYPES[a.dtype], _FP8_TYPES[b.dtype], CUDA_R_32F, device,
                                      (fast_accum, scale_mode, scales))
    else:
        plan.set_scales(*scales)
    alpha, beta = ctypes.c_float(1.0), ctypes.c_float(1.0 if accumulate else 0.0)
    _matmul(plan, ctypes.byref(alpha), ctypes.byref(beta), a, b, out)


def supports_bf16(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether bf16_mm can take these buffers: BF16 operands, a BF16 or FP32 output, as `supports` asks."""
    return _takes(a, b, out) and a.dtype == b.dtype == torch.bfloat16 and out.dtype in _OUT_TYPES


def bf16_mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, alpha: Optional[torch.Tensor] = None) -> None:
    """out (BF16 or FP32, M x N) = alpha * a @ b^T, a (M, K) and b (N, K) BF16 row-major, alpha a 0-d FP32 tensor on
    out's GPU read by the GEMM (1 where None): FP32 sums, scaled and rounded once to out's type, on the current CUDA
    stream. The caller checks `supports_bf16` first."""
    (m, k), (n, k_b) = a.shape, b.shape
    if out.shape != (m, n) or k_b != k or (alpha is not None and (alpha.dtype, alpha.numel()) != (torch.float32, 1)):
        raise ValueError(f"cublaslt.bf16_mm: a {tuple(a.shape)}, b {tuple(b.shape)}, out {tuple(out.shape)}, alpha "
                         f"{None if alpha is None else (alpha.dtype, tuple(alpha.shape))}")
    device = out.device.index
    key = (m, n, k, a.dtype, b.dtype, out.dtype, device)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _Plan(m, n, k, CUDA_R_16BF, CUDA_R_16BF, _OUT_TYPES[out.dtype], device)
    alpha = _device_scalar(1.0, device) if alpha is None else alpha
    _matmul(plan, ctypes.c_void_p(alpha.data_ptr()), ctypes.c_void_p(_device_scalar(0.0, device).data_ptr()), a, b, out)


@functools.cache
def _device_scalar(value: float, device: int) -> torch.Tensor:
    """A constant FP32 scalar on the GPU, made once: bf16_mm's default alpha and its beta."""
    return torch.full((), value, dtype=torch.float32, device=torch.device("cuda", device))


def _matmul(plan: _Plan, alpha, beta, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out = alpha * a @ b^T + beta * out with `plan`'s descriptors and algorithm (alpha and beta: host references
    or device pointers, as the plan's pointer mode says)."""
    device = out.device.index
    a_desc, b_desc, c_desc, d_desc = plan.layouts
    _check(library().cublasLtMatmul(
        _handle(device), plan.desc, alpha, b.data_ptr(), a_desc, a.data_ptr(), b_desc,
        beta, out.data_ptr(), c_desc, out.data_ptr(), d_desc, ctypes.byref(plan.heuristic.algo),
        _workspace(device).data_ptr(), WORKSPACE_BYTES, torch.cuda.current_stream(out.device).cuda_stream,
    ), "cublasLtMatmul")
