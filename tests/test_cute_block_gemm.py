"""recipes.fp8.cute_block_gemm without a GPU: every block pair and output compiled for Hopper (sm_90a) by CUTLASS's
DSL against fake tensors, then by Triton's ptxas: warp-specialised (TMA copies, setmaxnreg), the next K step's WGMMA
in flight while a product is promoted, the scales read from shared memory (no global load among the WGMMAs), CTA
pairs sharing B tiles by TMA multicast, 1x128-block scales copied by TMA with the tiles, no register spilled; the
scales' layouts; and the shapes it refuses. Its numerics: tests/test_gpu.py
on a GPU."""

from __future__ import annotations

import pytest
import torch

from recipes.fp8.blockwise import ACTIVATION_BLOCK, WEIGHT_BLOCK, quantize_blockwise
from recipes.fp8.cute_block_gemm import cute_block_scaled_gemm, kernel_scales, tile_group
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
# row-major; column-major (a K step's row scales contiguous) where TMA copies them
scales = lambda rows, block, tma: make_fake_compact_tensor(cutlass.Float32, (rows // block, K // 128),
                                                           stride_order=(0, 1) if tma and block == 1 else (1, 0),
                                                           assumed_align=16)
launches = [(1, 128, False, "bf16", 1, False), (1, 128, False, "fp32", 1, False), (1, 1, False, "bf16", 1, False),
            (1, 1, True, "fp32", 1, False), (128, 1, False, "bf16", 1, False), (1, 128, False, "bf16", 2, False),
            (1, 1, True, "fp32", 2, False), (1, 128, False, "bf16", 1, True), (1, 1, False, "bf16", 1, True),
            (1, 1, True, "fp32", 1, True), (128, 1, False, "bf16", 1, True), (1, 1, True, "fp32", 2, True)]
for a_rows, b_rows, accumulate, out, cluster_m, tma in launches:
    launch = (f"{a_rows}x{b_rows} {out}{' added' if accumulate else ''}{' pairs' if cluster_m > 1 else ''}"
              f"{' scales-by-TMA' if tma else ''}")
    dump = Path(sys.argv[1]).parent / launch.replace(" ", "_")
    dump.mkdir()
    d = make_fake_compact_tensor(cutlass.Float32 if out == "fp32" else cutlass.BFloat16, (M, N, 1),
                                 stride_order=(1, 0, 2), assumed_align=16)
    cute.compile(BlockScaledGemm(a_rows, b_rows, accumulate, cluster_m=cluster_m, scales_by_tma=tma), operand(M),
                 operand(N), scales(M, a_rows, tma), scales(N, b_rows, tma), d, 66 if cluster_m > 1 else 132,
                 make_fake_stream(), options=f"--keep-ptx --dump-dir={dump}")
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
    # TMA copies into A's and B's stages, and with scales by TMA into each 1x128-block operand's scale stages too
    # (told apart by their shared-memory offsets); with two such operands, no global load left for any lane to wait
    # on (an added output's values are loaded, by the math warpgroups)
    into = set(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global\S*\s+\[%r\d+(\+\d+)?\]", ptx))
    assert len(into) == 2 + tma * ((a_rows == 1) + (b_rows == 1)), f"{launch}: TMA copies into {into}"
    if tma and a_rows == b_rows == 1 and not accumulate:
        assert "ld.global" not in ptx, f"{launch}: global loads"
"""


def test_every_pair_compiles_for_hopper_warp_specialised_without_spills(tmp_path):
    run_compiled(HOPPER_COMPILE, tmp_path, env={"CUTE_DSL_ARCH": "sm_90a"})


def test_scales_are_handed_over_in_the_layout_each_path_reads():
    # TMA copies a K step's 128 row scales as one 512-byte column: column-major, where the blockwise producer kernel
    # already writes them (no copy then); the copying warp's lanes read row-major scales
    x = torch.randn(384, 512)
    for block in (ACTIVATION_BLOCK, WEIGHT_BLOCK):
        operand = quantize_blockwise(x, E4M3, block)
        for by_tma in (False, True):
            scales = kernel_scales(operand, by_tma)
            assert torch.equal(scales, operand.scale_inv)
            column_major = by_tma and block == ACTIVATION_BLOCK
            assert scales.stride() == ((1, scales.shape[0]) if column_major else (scales.shape[1], 1))
    activations = quantize_blockwise(x, E4M3, ACTIVATION_BLOCK)
    produced = activations._replace(scale_inv=activations.scale_inv.t().contiguous().t())  # the producer's layout
    assert kernel_scales(produced, True).data_ptr() == produced.scale_inv.data_ptr()


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
