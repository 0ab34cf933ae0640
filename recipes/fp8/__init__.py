"""FP8 training for the torch engine. `Fp8Training` (training.py) is what the engine calls; below it the FP8 linear
layer (linear.py), the scaling recipes' quantization (current_scaling.py, delayed_scaling.py, blockwise.py,
mxfp8.py), FSDP2's FP8 weight tensors (all_gather.py) and one FP8 GEMM (gemm.py)."""

from recipes.fp8.training import Fp8Training

__all__ = ["Fp8Training"]
