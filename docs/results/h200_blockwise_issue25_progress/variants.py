"""Exploration script as run on the H200 for issue 25 at bd751c9 (not part of the product or the suites), from the
repo root: `PYTHONPATH=$PWD:docs/results/h200_blockwise_issue25_progress python3
docs/results/h200_blockwise_issue25_progress/variants.py`. Times the blockwise kernel's strips split by orientation
(rows only, transposed columns only, both) and with the hardware's FP8 conversion for the transposed strips, and a
one-program-per-128x128-tile variant; checks each variant's bytes against produce_fp8_1x128's."""
import torch, triton
from recipes.fp8 import fused_quantize as fq
from recipes.fp8.formats import E4M3
from variant_kernels import _strip_kernel, _full_tile_kernel

SHAPES = [("swiglu", (8192, 28672), None), ("swiglu_backward", (8192, 14336), (8192, 28672)),
          ("identity", (8192, 4096), None), ("squared_relu_backward", (4096, 24576), (4096, 24576)),
          ("swiglu_backward", (256, 384), (256, 768))]
fmt = fq._format_args(E4M3)
fmt.pop("SOFTWARE")
for op, ashape, bshape in SHAPES:
    a = (torch.randn(ashape, device="cuda") * 3).to(torch.bfloat16)
    b = None if bshape is None else (torch.randn(bshape, device="cuda") * 3).to(torch.bfloat16)
    ref = fq.produce_fp8_1x128(op, a, b, E4M3)
    code, a2, b2, rows, cols, width, _ = fq._operands(op, a, b)
    nbytes = a.nbytes + (0 if b is None else b.nbytes) + 2 * rows * width + 8 * rows * width // 128
    def outputs():
        return (torch.zeros((rows, width), dtype=E4M3, device="cuda"), torch.zeros((rows, width // 128), device="cuda"),
                torch.zeros((width, rows), dtype=E4M3, device="cuda"), torch.zeros((width, rows // 128), device="cuda"))
    variants = []
    for sub, w in ((16, 4), (32, 8)):
        for which, hw in ((0, False), (1, False), (2, False), (0, True), (2, True)):
            variants.append((f"strip SUB={sub} w={w} which={which} hwcol={hw}", _strip_kernel, (rows // 128 * 2 * (128 // sub), cols // 128), dict(SUB=sub, WHICH=which, HW=hw), w, which))
    for w in (16,):
        for hw, swr in ((False, False), (True, False)):
            variants.append((f"full w={w} hwcol={hw} swrows={swr}", _full_tile_kernel, (rows // 128, cols // 128), dict(HW=hw, SW_ROWS=swr), w, 0))
    for name, kernel, grid, kw, w, which in variants:
        try:
            o = outputs()
            run = lambda: kernel[grid](a2, b2, o[0], o[1], o[2], o[3], rows, cols, a2.shape[1], b2.shape[1], OP=code, B=128, **fmt, **kw, num_warps=w)
            run(); torch.cuda.synchronize()
            same = []
            if which != 2:
                same.append(torch.equal(o[0].view(torch.uint8), ref[0].view(torch.uint8)) and torch.equal(o[1], ref[1]))
            if which != 1:
                same.append(torch.equal(o[2].view(torch.uint8), ref[2].view(torch.uint8)) and torch.equal(o[3], ref[3]))
            ms = triton.testing.do_bench(run, return_mode="median")
            print(f"{op} {ashape} {name}: {ms:.3f} ms {nbytes / ms / 1e6:.0f} GB/s bytes={'ok' if all(same) else 'WRONG'}", flush=True)
        except Exception as e:
            print(f"{op} {name}: {type(e).__name__} {str(e)[:200]}", flush=True)
