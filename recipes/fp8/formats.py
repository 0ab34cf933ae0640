"""FP8 formats (OCP FP8): E4M3 for values that must be precise, E5M2 for gradients that need range; and E2M1, the
4-bit values of NVFP4 (recipes.fp8.nvfp4), stored two to a byte."""

from __future__ import annotations

import functools

import torch

from recipes.config import Fp8Format

E4M3 = torch.float8_e4m3fn  # max 448, smallest normal 2**-6, smallest subnormal 2**-9, no infinities
E5M2 = torch.float8_e5m2  # max 57344, has infinities


def fp8_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


def forward_and_backward_dtypes(fp8_format: Fp8Format) -> tuple[torch.dtype, torch.dtype]:
    """HYBRID: E4M3 for activations and weights, E5M2 for gradients; E4M3: E4M3 for all three."""
    return (E4M3, E5M2) if fp8_format == Fp8Format.hybrid else (E4M3, E4M3)


E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; code | 8 is the negative


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (rows, K) as bytes (rows, K / 2), the even element in the low nibble: as Transformer Engine and
    torchao pack them, and as PyTorch's float4_e2m1fn_x2 (what cuBLAS's FP4 GEMMs read) holds them."""
    return codes[:, ::2] | (codes[:, 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """The codes (rows, K) of packed bytes (rows, K / 2)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    """The FP32 values (rows, K) of packed E2M1 bytes."""
    return _e2m1_table(packed.device)[unpack_e2m1(packed).long()]


@functools.lru_cache(maxsize=None)
def _e2m1_table(device: torch.device) -> torch.Tensor:
    """FP32 value of each of the 16 E2M1 codes, built once per device (no host-to-device copy per call); never
    written."""
    return torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=device)
