"""Exploration script as run on the H200 for issue 25 (not part of the product or the suites), from the repo root:
`PYTHONPATH=$PWD python3 docs/results/h200_blockwise_packed_issue25/pack_configs.py`. Times produce_fp8_1x128's
kernel for every strip width, warp count and both column-strip forms (PACK=1: four rows' FP8 bytes packed into one
int32 word before the transpose; PACK=0: the bytes transposed), at the five proxies' op shapes, with each
configuration's bytes and scales checked against the unfused blockwise quantization."""
import torch
import triton

from recipes.fp8 import fused_quantize as fq
from recipes.fp8.activation_ops import reference_output
from recipes.fp8.blockwise import quantize_blockwise
from recipes.fp8.formats import E4M3

# (proxy, op, a's shape, b's shape): tokens x hidden for the linears' inputs and gradients, the MLP's activation
# and its gradient.
SHAPES = [("llama3_8b", "identity", (8192, 4096), None), ("llama3_8b", "swiglu", (8192, 28672), None),
          ("llama3_8b", "swiglu_backward", (8192, 14336), (8192, 28672)),
          ("llama3_70b", "swiglu_backward", (8192, 28672), (8192, 57344)),
          ("nemotron4_15b", "identity", (4096, 6144), None), ("nemotron4_15b", "squared_relu", (4096, 24576), None),
          ("nemotron4_15b", "squared_relu_backward", (4096, 24576), (4096, 24576)),
          ("nemotron4_340b", "identity", (4096, 18432), None)]
CONFIGS = [(sub, warps, pack) for sub, warps in ((16, 4), (32, 8), (16, 8), (32, 4)) for pack in (1, 0)]


def main() -> None:
    src = torch.empty(2**28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    print(f"copy {2 * src.nbytes / copy_ms / 1e6:.0f} GB/s", flush=True)
    for proxy, op, a_shape, b_shape in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        a = (torch.randn(a_shape, device="cuda", generator=g) * 3).to(torch.bfloat16)
        b = None if b_shape is None else (torch.randn(b_shape, device="cuda", generator=g) * 3).to(torch.bfloat16)
        code, a2, b2, rows, cols, width, _ = fq._operands(op, a, b)
        ref = reference_output(op, a, b)
        expected = (quantize_blockwise(ref, E4M3, (1, 128)), quantize_blockwise(ref.t().contiguous(), E4M3, (1, 128)))
        del ref
        nbytes = a.nbytes + (0 if b is None else b.nbytes) + 2 * rows * width + 8 * rows * width // 128
        for sub, warps, pack in CONFIGS:
            data, data_t = torch.empty((rows, width), dtype=E4M3, device="cuda"), torch.empty((width, rows), dtype=E4M3, device="cuda")
            s, s_t = (torch.empty_strided(shape, (1, shape[0]), device="cuda") for shape in ((rows, width // 128), (width, rows // 128)))
            grid = (rows // 128 * 2 * (128 // sub), cols // 128)

            def run():
                fq._fp8_1x128_producer_kernel[grid](a2, b2, data, s, data_t.view(torch.int32), s_t, rows, cols,
                                                    a2.shape[1], b2.shape[1], OP=code, B=128, **fq._format_args(E4M3),
                                                    SUB=sub, PACK=pack, num_warps=warps)
            try:
                run()
                torch.cuda.synchronize()
                ok = all(torch.equal(d.view(torch.uint8), e.data.view(torch.uint8)) and torch.equal(sc, e.scale_inv)
                         for (d, sc), e in zip(((data, s), (data_t, s_t)), expected))
                ms = triton.testing.do_bench(run, return_mode="median")
                print(f"{proxy} {op} {a_shape} SUB={sub} w={warps} PACK={pack}: {ms:.3f} ms "
                      f"{nbytes / ms / 1e6:.0f} GB/s bytes={'ok' if ok else 'WRONG'}", flush=True)
            except Exception as e:  # noqa: BLE001 (a config that fails to compile is reported, the sweep goes on)
                print(f"{proxy} {op} SUB={sub} w={warps} PACK={pack}: {type(e).__name__} {str(e)[:200]}", flush=True)


main()
