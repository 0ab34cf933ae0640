# Issue 51: recipes.fp8.nvfp4's quantizer against Transformer Engine 2.20.2's own reference quantizer class
# (transformer_engine/pytorch/custom_recipes/reference_nvfp4.py, pure PyTorch) on a CPU, on the adversarial cases of
# tests/nvfp4_checks.py. TE's package cannot be imported without its CUDA core library, so its three pure-PyTorch
# files are unpacked from the wheel into a temporary folder beside a stand-in for the two base classes and the one
# helper they import from the C-extension side (Quantizer, QuantizedTensorStorage, is_custom: no arithmetic).
# E4M3 scales are compared as nvfp4_checks.same_e4m3 does, NaN's sign bit aside. tests/test_gpu.py runs the
# comparison with TE installed, on a GPU. From the repository root:
#   pip download --no-deps transformer-engine==2.20.2 -d WHEELS
#   python docs/results/cpu_nvfp4_te_reference_e96dabf/te_reference_check.py WHEELS/transformer_engine-2.20.2-py3-none-any.whl
import sys, tempfile, zipfile
from pathlib import Path

import torch

sys.path[:0] = [".", "tests"]
from recipes.fp8.nvfp4 import quantize_nvfp4, random_hadamard_transform
from nvfp4_checks import kernel_cases, same_e4m3

root = Path(tempfile.mkdtemp())
zipfile.ZipFile(sys.argv[1]).extractall(root, [f"transformer_engine/pytorch/custom_recipes/{name}.py"
                                               for name in ("reference_nvfp4", "reference_utils", "gemm")])
for package in ("transformer_engine", "transformer_engine/pytorch", "transformer_engine/pytorch/custom_recipes",
                "transformer_engine/pytorch/tensor"):
    (root / package).mkdir(exist_ok=True)
    (root / package / "__init__.py").touch()
(root / "transformer_engine/pytorch/quantized_tensor.py").write_text(
    "class QuantizedTensorStorage:\n    pass\n\n\n"
    "class Quantizer:\n    def __init__(self, *, rowwise=True, columnwise=True):\n"
    "        self.rowwise_usage, self.columnwise_usage, self.internal = rowwise, columnwise, False\n")
(root / "transformer_engine/pytorch/tensor/utils.py").write_text("def is_custom(x=None):\n    return True\n")
sys.path.insert(0, str(root))
from transformer_engine.pytorch.custom_recipes import reference_nvfp4
from transformer_engine.pytorch.custom_recipes.reference_utils import Fp4Formats

total = 0
for name, x in kernel_cases():
    for tile in (1, 16):
        if x.shape[0] % tile:
            continue
        columns = x.shape[0] % 16 == 0  # TE's column-wise copy (Hadamard-transformed for 1x16) needs rows % 16
        te = reference_nvfp4.NVFP4QuantizerRef(dtype=Fp4Formats.E2M1, quant_tile_shape=(tile, 16),
                                               with_rht=tile == 1 and columns, columnwise=columns).quantize(x)
        layouts = [("rowwise", quantize_nvfp4(x, (tile, 16)), te.data, te.scale, te.global_amax_row)]
        if columns:
            column = random_hadamard_transform(x.t().contiguous()) if tile == 1 else x.t().contiguous()
            layouts.append(("columnwise", quantize_nvfp4(column, (tile, 16)), te.data_t, te.scale_t,
                            te.global_amax_col))
        for layout, ours, data, scale, amax in layouts:
            scales = ours.block_scale.repeat_interleave(tile, dim=0).view(torch.uint8)
            codes = int((ours.codes != data.view(torch.uint8)).sum())
            theirs = scale.view(torch.uint8)[:scales.shape[0], :scales.shape[1]]
            # a NaN's sign bit is the hardware's (x86's invalid operations give -NaN): E4M3's 0x7F and 0xFF are both NaN
            wrong_scales = 0 if same_e4m3(scales, theirs) else int((scales != theirs).sum())
            same_amax = bool(torch.equal(ours.amax.view(1), amax.view(1))
                             or (ours.amax.isnan().all() and amax.isnan().all()))
            total += codes + wrong_scales + (not same_amax)
            print(f"{name:22s} {tile:2d}x16 {layout:10s} code mismatches {codes} scale mismatches {wrong_scales} "
                  f"amax equal {same_amax}")
print(f"mismatches in all: {total}")
sys.exit(total != 0)
