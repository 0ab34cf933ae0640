"""recipes.fp8.cute_block_gemm without a GPU: every block pair and output compiled for Hopper (sm_90a) by CUTLASS's
DSL against fake tensors, then by Triton's ptxas: warp-specialised (TMA copies, setmaxnreg), the next K step's WGMMA
in flight while a product is promoted, the scales read from shared memory (no global load among the WGMMAs), CTA
pairs sharing B tiles by TMA multicast, no register spilled; and the shapes it refuses. Its numerics: tests/test_gpu.py
on a GPU."""

from __future__ import annotations

import pytest
import torch

from recipes.fp8.blockwise import ACTIVATION_BLOCK, WEIGHT_BLOCK, quantize_blockwise
from recipes.fp8.cute_block_gemm import cute_block_scaled_gemm, tile_group
from recipes.fp8.formats import E4M3

from hopper_compile import run_compiled

# (a block rows, b block rows, accumulate, output): the forward and input-gradient pair into BF16 and FP32, the
# weight gradient's into BF16 and added into FP32, and the other 1x128 pair; each compiled, its PTX assembled, checked.
HOPPER_COMPILE = r"""
import re, sys
from pathlib import Path
import cutlass, cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
from hopper_compile import ptxas, sass
from recipes.fp8.cute_block_gemm import BlockScaledGemm

M, N, K = 512, 1024, 1024  # N: 8 tiles, taken side by side in one group (cute_block_gemm.tile_group)
operand = lambda rows: make_fake_compact_tensor(cutlass.Float8E4M3FN, (rows, K, 1), stride_order=(1, 0, 2),
                                                assumed_align=16)
scales = lambda rows, block: make_fake_compact_tensor(cutlass.Float32, (rows // block, K // 128), stride_order=(1, 0))
launches = [(1, 128, False, "bf16", 1), (1, 128, False, "fp32", 1), (1, 1, False, "bf16", 1),
            (1, 1, True, "fp32", 1), (128, 1, False, "bf16", 1), (1, 128, False, "bf16", 2), (1, 1, True, "fp32", 2)]
for a_rows, b_rows, accumulate, out, cluster_m in launches:
    launch = f"{a_rows}x{b_rows} {out}{' added' if accumulate else ''}{' pairs' if cluster_m > 1 else ''}"
    dump = Path(sys.argv[1]).parent / launch.replace(" ", "_")
    dump.mkdir()
    d = make_fake_compact_tensor(cutlass.Float32 if out == "fp32" else cutlass.BFloat16, (M, N, 1),
                                 stride_order=(1, 0, 2), assumed_align=16)
    cute.compile(BlockScaledGemm(a_rows, b_rows, accumulate, cluster_m=cluster_m), operand(M), operand(N),
                 scales(M, a_rows), scales(N, b_rows), d, 66 if cluster_m > 1 else 132, make_fake_stream(),
                 options=f"--keep-ptx --dump-dir={dump}")
    (ptx_file,) = dump.rglob("*.ptx")
    ptx = ptx_file.read_text()
    spilled, registers = ptxas(ptx_file)
    print(launch, "registers", registers, "spilled", spilled, flush=True)
    copies = "cp.async.bulk.tensor" in ptx and "setmaxnreg" in ptx
    assert copies, f"{launch}: not TMA copies by a warpgroup of their own"
    assert "wgmma.mma_async" in ptx, launch
    # CTA pairs: each copies half of their shared B tile into both with TMA multicast
    assert ("multicast::cluster" in ptx) == (cluster_m > 1), f"{launch}: multicast copies {cluster_m > 1}"
    # the promotion waits for all but the newest WGMMA group: the next K step's product forms meanwhile
    assert re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx), f"{launch}: each product waited for"
    assert spilled == 0, f"{launch} spills {spilled} bytes"
    # the scales come through shared memory: no global load among the math warpgroups' WGMMAs (one there made
    # them wait out its latency every K step)
    code = [line for line in sass(ptx_file).splitlines() if "QGMMA" in line or "LDG" in line]
    wgmmas = [i for i, line in enumerate(code) if "QGMMA" in line]
    loads = [line for line in code[wgmmas[0]:wgmmas[-1]] if "LDG" in line]
    assert not loads, f"{launch}: global loads in the main loop: {loads}"
"""


def test_every_pair_compiles_for_hopper_warp_specialised_without_spills(tmp_path):
    run_compiled(HOPPER_COMPILE, tmp_path, env={"CUTE_DSL_ARCH": "sm_90a"})


def test_shapes_it_cannot_take_are_refused_before_the_gpu():
    a = quantize_blockwise(torch.randn(200, 512), E4M3, ACTIVATION_BLOCK)
    b = quantize_blockwise(torch.randn(256, 512), E4M3, WEIGHT_BLOCK)
    with pytest.raises(ValueError, match="M a multiple of 128"):
        cute_block_scaled_gemm(a, b)
    a = quantize_blockwise(torch.randn(384, 512), E4M3, ACTIVATION_BLOCK)
    with pytest.raises(ValueError, match="M a multiple of 256"):
        cute_block_scaled_gemm(a, b, cluster_m=2)
    a = quantize_blockwise(torch.randn(256, 384), E4M3, ACTIVATION_BLOCK)
    b = quantize_blockwise(torch.randn(256, 384), E4M3, WEIGHT_BLOCK)
    with pytest.raises(ValueError, match="K of 256"):
        cute_block_scaled_gemm(a, b)
    a = quantize_blockwise(torch.randn(256, 512), E4M3, ACTIVATION_BLOCK)
    b = quantize_blockwise(torch.randn(256, 512), E4M3, WEIGHT_BLOCK)
    with pytest.raises(ValueError, match="accumulating needs an FP32 output"):
        cute_block_scaled_gemm(a, b, out=torch.zeros(256, 256, dtype=torch.bfloat16), accumulate=True)


def test_tiles_are_taken_in_groups_of_n_tiles_that_end_where_n_ends():
    # CUTLASS's scheduler pads N to a multiple of the group: a group that does not divide the N tiles would hand out
    # tiles past the output's edge
    for n_tiles in range(1, 100):
        group = tile_group(n_tiles)
        assert n_tiles % group == 0 and group in (1, 2, 4, 8), (n_tiles, group)
        assert group == 8 or n_tiles % (2 * group), (n_tiles, group)
