"""FP8 formats (OCP FP8): E4M3 for values that must be precise, E5M2 for gradients that need range."""

from __future__ import annotations

import torch

from recipes.config import Fp8Format

E4M3 = torch.float8_e4m3fn  # max 448, smallest normal 2**-6, smallest subnormal 2**-9, no infinities
E5M2 = torch.float8_e5m2  # max 57344, has infinities


def fp8_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


def forward_and_backward_dtypes(fp8_format: Fp8Format) -> tuple[torch.dtype, torch.dtype]:
    """HYBRID: E4M3 for activations and weights, E5M2 for gradients; E4M3: E4M3 for all three."""
    return (E4M3, E5M2) if fp8_format == Fp8Format.hybrid else (E4M3, E4M3)
