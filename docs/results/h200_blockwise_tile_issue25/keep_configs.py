"""Exploration script as run on the H200 for issue 25 (not part of the product or the suites), from the repo root:
`PYTHONPATH=$PWD python3 docs/results/h200_blockwise_tile_issue25/keep_configs.py`. Times produce_fp8_1x128's kernel
(one 128 x 128 tile per program, in strips: SUB, warps, KEEP) at the five proxies' op shapes in every form the
autotuner may choose and a few more, each form's bytes and scales checked against the unfused blockwise
quantization, and the kernel it replaces (one strip of a tile per program: 0365bc2's recipes/fp8/fused_quantize.py,
read with `git show`; HEAD when it ran) in each of its forms."""
import importlib.util
import subprocess
import sys
import tempfile

import torch
import triton

from recipes.fp8 import fused_quantize as fq
from recipes.fp8.activation_ops import reference_output
from recipes.fp8.blockwise import quantize_blockwise
from recipes.fp8.formats import E4M3

# (proxy, op, a's shape, b's shape): tokens x width for the linears' inputs and gradients, the MLP's activation and
# its gradient, per micro-batch.
SHAPES = [("llama3_8b", "identity", (8192, 4096), None), ("llama3_8b", "swiglu", (8192, 28672), None),
          ("llama3_8b", "swiglu_backward", (8192, 14336), (8192, 28672)),
          ("llama3_70b", "identity", (8192, 8192), None), ("llama3_70b", "swiglu", (8192, 57344), None),
          ("llama3_70b", "swiglu_backward", (8192, 28672), (8192, 57344)),
          ("llama31_405b", "identity", (8192, 16384), None),
          ("llama31_405b", "swiglu_backward", (8192, 53248), (8192, 106496)),
          ("nemotron4_15b", "identity", (4096, 6144), None), ("nemotron4_15b", "squared_relu", (4096, 24576), None),
          ("nemotron4_15b", "squared_relu_backward", (4096, 24576), (4096, 24576)),
          ("nemotron4_340b", "identity", (4096, 18432), None),
          ("nemotron4_340b", "squared_relu", (4096, 73728), None),
          ("nemotron4_340b", "squared_relu_backward", (4096, 73728), (4096, 73728))]
FORMS = [(sub, warps, keep) for sub, warps in ((16, 4), (32, 4), (32, 8), (16, 8), (64, 8)) for keep in (0, 1)]
OLD_FORMS = [(16, 4, 0), (32, 8, 0), (16, 8, 1), (32, 8, 1), (16, 4, 1)]  # (SUB, warps, PACK)


def old_module():
    """The strip kernel as the last commit has it."""
    source = subprocess.run(["git", "show", "0365bc2:recipes/fp8/fused_quantize.py"], capture_output=True, text=True,
                            check=True).stdout
    path = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
    path.write(source)
    path.close()
    spec = importlib.util.spec_from_file_location("strip_fused_quantize", path.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed(label, run, outputs, expected, nbytes):
    try:
        run()
        torch.cuda.synchronize()
        ok = all(torch.equal(d.view(torch.uint8), e.data.view(torch.uint8)) and torch.equal(s, e.scale_inv)
                 for (d, s), e in zip(outputs, expected))
        ms = triton.testing.do_bench(run, return_mode="median")
        print(f"{label}: {ms:.3f} ms {nbytes / ms / 1e6:.0f} GB/s bytes={'ok' if ok else 'WRONG'}", flush=True)
        return ms
    except Exception as e:  # noqa: BLE001 (a form that fails is reported, the sweep goes on)
        print(f"{label}: {type(e).__name__} {str(e)[:300]}", flush=True)
        return float("inf")


def main() -> None:
    old = old_module()
    src = torch.empty(2**28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    print(f"copy {2 * src.nbytes / copy_ms / 1e6:.0f} GB/s", flush=True)
    del src, dst
    summary = []
    for proxy, op, a_shape, b_shape in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        a = (torch.randn(a_shape, device="cuda", generator=g) * 3).to(torch.bfloat16)
        b = None if b_shape is None else (torch.randn(b_shape, device="cuda", generator=g) * 3).to(torch.bfloat16)
        code, a2, b2, rows, cols, width, _ = fq._operands(op, a, b)
        ref = reference_output(op, a, b)
        expected = (quantize_blockwise(ref, E4M3, (1, 128)), quantize_blockwise(ref.t().contiguous(), E4M3, (1, 128)))
        del ref
        nbytes = a.nbytes + (0 if b is None else b.nbytes) + 2 * rows * width + 8 * rows * width // 128
        data, data_t = (torch.empty(shape, dtype=E4M3, device="cuda") for shape in ((rows, width), (width, rows)))
        s, s_t = (torch.empty_strided(shape, (1, shape[0]), device="cuda")
                  for shape in ((rows, width // 128), (width, rows // 128)))
        outputs = ((data, s), (data_t, s_t))
        scratch = a2 if op == "identity" else torch.empty((rows, width), dtype=torch.int16, device="cuda")
        args = (a2, b2, fq._bytes(data), s, data_t.view(torch.int32), s_t, rows, cols, a2.shape[1], b2.shape[1])
        best = {}
        for sub, warps, keep in FORMS:
            if keep and op == "identity":
                continue  # identity keeps nothing: its input is its output
            label = f"{proxy} {op} {a_shape} tile SUB={sub} w={warps} KEEP={keep}"
            ms = timed(label, lambda: fq._fp8_1x128_producer_kernel[(rows // 128, cols // 128)](
                *args[:6], scratch, *args[6:], OP=code, B=128, **fq._format_args(E4M3), SUB=sub, KEEP=keep,
                num_warps=warps), outputs, expected, nbytes)
            best["tile"] = min(best.get("tile", float("inf")), ms)
        for sub, warps, pack in OLD_FORMS:
            label = f"{proxy} {op} {a_shape} strips SUB={sub} w={warps} PACK={pack}"
            ms = timed(label, lambda: old._fp8_1x128_producer_kernel[(rows // 128 * 2 * (128 // sub), cols // 128)](
                *args, OP=code, B=128, **old._format_args(E4M3), SUB=sub, PACK=pack, num_warps=warps),
                outputs, expected, nbytes)
            best["strips"] = min(best.get("strips", float("inf")), ms)
        label = f"{proxy} {op} {a_shape} produce_fp8_1x128 (autotuned)"
        product = fq.produce_fp8_1x128(op, a, b, E4M3)  # autotunes on its first call
        ok = all(torch.equal(d.view(torch.uint8), e.data.view(torch.uint8)) and torch.equal(sc, e.scale_inv)
                 for (d, sc), e in zip(((product[0], product[1]), (product[2], product[3])), expected))
        ms = triton.testing.do_bench(lambda: fq.produce_fp8_1x128(op, a, b, E4M3), return_mode="median")
        print(f"{label}: {ms:.3f} ms bytes={'ok' if ok else 'WRONG'}", flush=True)
        summary.append(f"{proxy} {op} {a_shape}: best tile {best['tile']:.3f} ms, best strips {best['strips']:.3f} ms"
                       f" ({best['strips'] / best['tile']:.2f}x), produce_fp8_1x128 {ms:.3f} ms")
        del a, b, a2, b2, expected, data, data_t, s, s_t, outputs, args, product, scratch
        torch.cuda.empty_cache()
    print("\n".join(["", "summary (medians):"] + summary), flush=True)
    sys.stdout.flush()


main()
