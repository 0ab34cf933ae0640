"""recipes.fp8.cute_block_gemm without a GPU: every block pair and output compiled for Hopper (sm_90a) by CUTLASS's
DSL against fake tensors, then by Triton's ptxas: warp-specialised (TMA copies, setmaxnreg), the next K step's WGMMA
in flight while a product is promoted, no register spilled; and the shapes it refuses. Its numerics: tests/test_gpu.py
on a GPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipes.fp8.blockwise import ACTIVATION_BLOCK, WEIGHT_BLOCK, quantize_blockwise
from recipes.fp8.cute_block_gemm import cute_block_scaled_gemm
from recipes.fp8.formats import E4M3

COMPILE = r"""
import sys
import cutlass, cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
from recipes.fp8.cute_block_gemm import BlockScaledGemm

a_rows, b_rows, accumulate, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
M, N, K = 512, 384, 1024
operand = lambda rows: make_fake_compact_tensor(cutlass.Float8E4M3FN, (rows, K, 1), stride_order=(1, 0, 2),
                                                assumed_align=16)
scales = lambda rows, block: make_fake_compact_tensor(cutlass.Float32, (rows // block, K // 128), stride_order=(1, 0))
d = make_fake_compact_tensor(cutlass.Float32 if out == "fp32" else cutlass.BFloat16, (M, N, 1),
                             stride_order=(1, 0, 2), assumed_align=16)
kernel = BlockScaledGemm(a_rows, b_rows, accumulate)
cute.compile(kernel, operand(M), operand(N), scales(M, a_rows), scales(N, b_rows), d, 132, make_fake_stream(),
             options="--keep-ptx --dump-dir=" + sys.argv[5])
"""

# (a block rows, b block rows, accumulate, output): the forward and input-gradient pair into BF16 and FP32, the
# weight gradient's into BF16 and added into FP32, and the other 1x128 pair.
LAUNCHES = [(1, 128, False, "bf16"), (1, 128, False, "fp32"), (1, 1, False, "bf16"), (1, 1, True, "fp32"),
            (128, 1, False, "bf16")]


@pytest.mark.parametrize("a_rows,b_rows,accumulate,out", LAUNCHES)
def test_every_pair_compiles_for_hopper_warp_specialised_without_spills(a_rows, b_rows, accumulate, out, tmp_path):
    from triton import knobs

    ptxas = knobs.nvidia.ptxas_blackwell.path
    if not Path(ptxas or "").is_file():
        pytest.skip("this Triton ships no ptxas for Hopper")
    path = [str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH")]
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "PYTHONPATH": os.pathsep.join(filter(None, path))}
    result = subprocess.run([sys.executable, "-c", COMPILE, str(a_rows), str(b_rows), str(int(accumulate)), out,
                             str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    (ptx_file,) = tmp_path.rglob("*.ptx")
    ptx = ptx_file.read_text()
    assert "cp.async.bulk.tensor" in ptx and "setmaxnreg" in ptx, "not TMA copies by a warpgroup of their own"
    assert "wgmma.mma_async" in ptx
    # the promotion waits for all but the newest WGMMA group: the next K step's product forms meanwhile
    assert re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)
    log = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", str(ptx_file), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True, check=True).stderr
    assert int(re.search(r"(\d+) bytes spill stores", log).group(1)) == 0, log


def test_shapes_it_cannot_take_are_refused_before_the_gpu():
    a = quantize_blockwise(torch.randn(200, 512), E4M3, ACTIVATION_BLOCK)
    b = quantize_blockwise(torch.randn(256, 512), E4M3, WEIGHT_BLOCK)
    with pytest.raises(ValueError, match="M a multiple of 128"):
        cute_block_scaled_gemm(a, b)
    a = quantize_blockwise(torch.randn(256, 384), E4M3, ACTIVATION_BLOCK)
    b = quantize_blockwise(torch.randn(256, 384), E4M3, WEIGHT_BLOCK)
    with pytest.raises(ValueError, match="K of 256"):
        cute_block_scaled_gemm(a, b)
    a = quantize_blockwise(torch.randn(256, 512), E4M3, ACTIVATION_BLOCK)
    b = quantize_blockwise(torch.randn(256, 512), E4M3, WEIGHT_BLOCK)
    with pytest.raises(ValueError, match="accumulating needs an FP32 output"):
        cute_block_scaled_gemm(a, b, out=torch.zeros(256, 256, dtype=torch.bfloat16), accumulate=True)
