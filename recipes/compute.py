"""The dtype of what a GPU computes in BF16 (every GEMM but the FP8 ones, attention, the residual stream):
`trainer.compute_dtype`.

On a CPU without native BF16 (no AVX512 or AMX: `torch.ops.mkldnn._is_mkldnn_bf16_supported()` is False, as on
AVX2-only CPUs such as AMD EPYC Rome/Milan, most laptops and CI runners) PyTorch's BF16 GEMMs take a generic loop
20-40x slower than its FP32 GEMMs, so `auto` computes in FP32 there and in BF16 everywhere else. The FP8 GEMMs are
the same either way: their FP8 operands are multiplied in FP32 on a CPU (recipes.fp8.gemm), and a BF16 input
quantizes to the same bytes and scale whether it arrives in BF16 or FP32 (tests/test_compute.py).

`mm_into` is the BF16 weight-gradient GEMM that writes into, or adds to, an FP32 main gradient: the torch engine's
(recipes.fp8.linear, the output layer in recipes.models.loss) and megatron-core's own linears' without Apex
(recipes.megatron.wgrad).
"""

from __future__ import annotations

import torch

from recipes.config import ComputeDtype, Config, ConfigError, Engine, ExecutorName

DTYPES = {ComputeDtype.bf16: torch.bfloat16, ComputeDtype.fp32: torch.float32}
NAMES = {dtype: setting.value for setting, dtype in DTYPES.items()}


def cpu_has_native_bf16() -> bool:
    """Whether PyTorch runs BF16 GEMMs on this CPU through oneDNN's native BF16 kernels (AVX512, AMX; ARM BF16)."""
    return (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def compute_dtype(setting: ComputeDtype, device_type: str) -> torch.dtype:
    """The dtype `setting` computes in on a device of `device_type` ("cuda" or "cpu")."""
    if setting == ComputeDtype.auto:
        return torch.bfloat16 if device_type == "cuda" or cpu_has_native_bf16() else torch.float32
    if setting == ComputeDtype.fp32 and device_type == "cuda":
        raise ConfigError("trainer.compute_dtype=fp32 is for CPUs without native BF16; GPUs compute in BF16: "
                          "set trainer.compute_dtype=auto")
    return DTYPES[setting]


def check_compute_dtype(cfg: Config) -> None:
    """Before launch: the setting applies to the run's engine and device (ConfigError naming the fix if not)."""
    if cfg.engine == Engine.nemo and cfg.trainer.compute_dtype != ComputeDtype.auto:
        raise ConfigError("trainer.compute_dtype is the torch and megatron engines'; engine=nemo computes in BF16 "
                          "(NeMo's bf16-mixed): leave it at auto")
    compute_dtype(cfg.trainer.compute_dtype, "cpu" if cfg.gpu.arch == "cpu" else "cuda")


def run_compute_dtype(cfg: Config) -> torch.dtype:
    """The compute dtype of the run `cfg` on this machine's device (CUDA when there is one)."""
    return compute_dtype(cfg.trainer.compute_dtype, "cuda" if torch.cuda.is_available() else "cpu")


def describe_compute(cfg: Config) -> str:
    """The plan's line: which dtype computes what a GPU computes in BF16, and why."""
    setting = cfg.trainer.compute_dtype
    device_type = "cpu" if cfg.gpu.arch == "cpu" else "cuda"
    dtype = NAMES[compute_dtype(setting, device_type)]
    if setting != ComputeDtype.auto:
        return f"{dtype} (trainer.compute_dtype={setting.value})"
    if device_type == "cuda":
        return dtype
    if cfg.executor.name != ExecutorName.local:
        return "bf16 where the node's CPU has native BF16 (AVX512, AMX), else fp32 (trainer.compute_dtype=auto)"
    if dtype == "bf16":
        return "bf16 (this CPU has native BF16; trainer.compute_dtype=fp32 computes in FP32)"
    return ("fp32 in place of BF16 (this CPU has no native BF16, where PyTorch's BF16 GEMMs are 20-40x slower; "
            "FP8 GEMMs unchanged; trainer.compute_dtype=bf16 forces BF16)")


@torch.library.custom_op("fp8_recipes::mm_into", mutates_args=("out",))
def mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    """BF16 `a @ b^T` into FP32 `out`: on CUDA one cuBLAS GEMM with FP32 output (beta = 1 to accumulate); on a CPU
    the BF16 values multiplied in FP32 (exact products, FP32 sums, as the GPU's GEMM)."""
    if a.is_cuda:
        if accumulate:
            torch.ops.aten.addmm.dtype_out(out, a, b.t(), torch.float32, out=out)
        else:
            torch.ops.aten.mm.dtype_out(a, b.t(), torch.float32, out=out)
    elif accumulate:
        out.add_(a.float() @ b.float().t())
    else:
        out.copy_(a.float() @ b.float().t())
