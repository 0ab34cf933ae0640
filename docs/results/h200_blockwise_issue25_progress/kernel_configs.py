"""Exploration script as run on the H200 for issue 25 at bd751c9 (not part of the product or the suites), from the
repo root: `python3 docs/results/h200_blockwise_issue25_progress/kernel_configs.py`. Times produce_fp8_1x128's
kernel for each (SUB, warps) at llama3_8b's and nemotron4_15b's MLP shapes (kernel_configs_d886fdb.log came from
its earlier form, for d886fdb's (SUB, Q, warps) tiles)."""
import sys
import torch, triton
from recipes.fp8 import fused_quantize as fq
from recipes.fp8.formats import E4M3

CONFIGS = [(c.kwargs["SUB"], c.num_warps) for c in fq._1X128_TILES] + [(16, 2), (64, 4), (128, 8), (128, 16)]
SHAPES = {"llama3_8b": [("swiglu", (8192, 28672), None), ("swiglu_backward", (8192, 14336), (8192, 28672)),
                        ("identity", (8192, 4096), None)],
          "nemotron4_15b": [("squared_relu", (4096, 24576), None),
                            ("squared_relu_backward", (4096, 24576), (4096, 24576)), ("identity", (4096, 6144), None)]}
neg_src = torch.zeros(128 << 20, dtype=torch.bfloat16, device="cuda"); neg_dst = torch.empty_like(neg_src)
copy = 2 * neg_src.nbytes / triton.testing.do_bench(lambda: torch.neg(neg_src, out=neg_dst), return_mode="median") / 1e6
print(f"copy {copy:.0f} GB/s")
for model, ops in SHAPES.items():
    for op, ashape, bshape in ops:
        a = torch.randn(ashape, device="cuda").to(torch.bfloat16)
        b = None if bshape is None else torch.randn(bshape, device="cuda").to(torch.bfloat16)
        code, a2, b2, rows, cols, width, _ = fq._operands(op, a, b)
        data, data_t = torch.empty((rows, width), dtype=E4M3, device="cuda"), torch.empty((width, rows), dtype=E4M3, device="cuda")
        s = torch.empty((rows, width // 128), device="cuda"); st = torch.empty((width, rows // 128), device="cuda")
        nbytes = a.nbytes + (0 if b is None else b.nbytes) + 2 * rows * width + 8 * rows * width // 128
        for sub, w in CONFIGS:
            def run():
                fq._fp8_1x128_producer_kernel[(rows // 128 * 2 * (128 // sub), cols // 128)](
                    a2, b2, fq._bytes(data), s, fq._bytes(data_t), st, rows, cols, a2.shape[1], b2.shape[1], OP=code,
                    B=128, **fq._format_args(E4M3), SUB=sub, num_warps=w)
            try:
                ms = triton.testing.do_bench(run, return_mode="median")
                print(f"{model} {op} SUB={sub} w={w}: {ms:.3f} ms {nbytes / ms / 1e6:.0f} GB/s ({nbytes / ms / 1e6 / copy:.2f} of copy)", flush=True)
            except Exception as e:
                print(f"{model} {op} {sub},{w}: {type(e).__name__} {e}"[:300], flush=True)
