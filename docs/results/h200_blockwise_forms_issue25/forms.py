"""Exploration script as run on the H200 for issue 25 (not part of the product or the suites), on the tree of commit
794e3e8, from the repo root: `PYTHONPATH=$PWD python3 docs/results/h200_blockwise_persistent_issue25/forms.py` (the
folder was renamed after the run; 22725b2 dropped the walking kept form it times). Times produce_fp8_1x128's kernel
at the five proxies' op shapes in every form the autotuner may choose (and the kept form with other numbers of
programs per SM), each form's bytes and scales checked against the unfused blockwise quantization; the autotuned
kernel as produce_fp8_1x128 launches it; the kernel of 8e84eba (one program per tile, a scratch the size of the
output; read with `git show`) in its forms; and Transformer Engine's 1x128 cast-transpose of the same tensor where the
op is identity."""
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

# (proxy, op, a's shape, b's shape) per micro-batch: the linears' inputs and gradients, the MLP's activation and its
# gradient.
SHAPES = [("llama3_8b", "identity", (8192, 4096), None), ("llama3_8b", "identity", (8192, 6144), None),
          ("llama3_8b", "swiglu", (8192, 28672), None),
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
KEPT_PER_SM = (2, 4, 8)  # the product runs fq._KEPT_PROGRAMS_PER_SM
OLD_FORMS = [(16, 4, 1), (32, 4, 1), (16, 4, 0), (32, 8, 0)]  # (SUB, warps, KEEP)
SMS = torch.cuda.get_device_properties(0).multi_processor_count


def old_module():
    source = subprocess.run(["git", "show", "8e84eba:recipes/fp8/fused_quantize.py"], capture_output=True, text=True,
                            check=True).stdout
    path = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
    path.write(source)
    path.close()
    spec = importlib.util.spec_from_file_location("tile_fused_quantize", path.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # registers its custom op again: the product is timed through its kernel
    return module


def same(outputs, expected):
    return all(torch.equal(d.view(torch.uint8), e.data.view(torch.uint8)) and torch.equal(s, e.scale_inv)
               for (d, s), e in zip(outputs, expected))


def timed(label, run, outputs, expected, nbytes):
    try:
        for d, s in outputs:
            d.view(torch.uint8).fill_(0x55)
            s.fill_(-1.0)
        run()
        torch.cuda.synchronize()
        ok = same(outputs, expected)
        ms = triton.testing.do_bench(run, return_mode="median")
        print(f"{label}: {ms:.3f} ms {nbytes / ms / 1e6:.0f} GB/s bytes={'ok' if ok else 'WRONG'}", flush=True)
        return ms
    except Exception as e:  # noqa: BLE001 (a form that fails is reported, the sweep goes on)
        print(f"{label}: {type(e).__name__} {str(e)[:300]}", flush=True)
        return float("inf")


def te_quantizer():
    try:
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
        return Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=True, force_pow_2_scales=True,
                                    block_scaling_dim=1)
    except Exception as e:  # noqa: BLE001
        print(f"Transformer Engine: {type(e).__name__} {e}", flush=True)
        return None


def main() -> None:
    old = old_module()
    te = te_quantizer()
    src = torch.empty(2**28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    print(f"copy {2 * src.nbytes / copy_ms / 1e6:.0f} GB/s; {SMS} SMs", flush=True)
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
        args = (a2, b2, fq._bytes(data), s, data_t.view(torch.int32), s_t)
        sizes = (rows, cols, a2.shape[1], b2.shape[1])
        slot = width // cols * 128 * 128
        scratch = torch.empty(max(KEPT_PER_SM) * SMS * slot, dtype=torch.int16, device="cuda")
        best = {}
        for config in fq._1x128_forms(fq._1X128_TILES, {}, OP=code):
            meta = config.kwargs
            for per_sm in KEPT_PER_SM if meta["KEEP"] else (None,):
                programs = fq._1x128_programs(meta, rows, cols, (per_sm or 0) * SMS)
                form = "kept" if meta["KEEP"] else "split" if meta["SPLIT"] else "recomputed"
                label = (f"{proxy} {op} {a_shape} SUB={meta['SUB']} w={config.num_warps} {form}"
                         + (f" {per_sm}/SM" if per_sm else "") + f" programs={programs}")
                ms = timed(label, lambda: fq._fp8_1x128_producer_kernel[(programs,)](
                    *args, scratch, *sizes, OP=code, B=128, **fq._format_args(E4M3), **meta,
                    num_warps=config.num_warps), outputs, expected, nbytes)
                if per_sm in (None, fq._KEPT_PROGRAMS_PER_SM):
                    best["new"] = min(best.get("new", float("inf")), ms)
        old_scratch = a2 if op == "identity" else torch.empty((rows, width), dtype=torch.int16, device="cuda")
        for sub, warps, keep in OLD_FORMS:
            if keep and op == "identity":
                continue
            label = f"{proxy} {op} {a_shape} 8e84eba SUB={sub} w={warps} KEEP={keep}"
            ms = timed(label, lambda: old._fp8_1x128_producer_kernel[(rows // 128, cols // 128)](
                *args, old_scratch, *sizes, OP=code, B=128, **old._format_args(E4M3), SUB=sub, KEEP=keep,
                num_warps=warps), outputs, expected, nbytes)
            best["old"] = min(best.get("old", float("inf")), ms)
        del old_scratch
        slots = fq._kept_programs(a.device)
        product_scratch = torch.empty((slots, slot), dtype=torch.int16, device="cuda")
        ms = timed(f"{proxy} {op} {a_shape} produce_fp8_1x128's launch (autotuned)",
                   lambda: fq._FP8_1X128_KERNEL[lambda meta: (fq._1x128_programs(meta, rows, cols, slots),)](
                       *args, product_scratch, *sizes, OP=code, B=128, **fq._format_args(E4M3)),
                   outputs, expected, nbytes)
        chosen = fq._FP8_1X128_KERNEL.best_config
        line = (f"{proxy} {op} {a_shape}: autotuned {ms:.3f} ms ({chosen.kwargs}, {chosen.num_warps} warps), best new"
                f" {best['new']:.3f}, best 8e84eba {best['old']:.3f} ({best['old'] / ms:.2f}x)")
        if op == "identity" and te is not None:
            te_ms = triton.testing.do_bench(lambda: te(a), return_mode="median")
            print(f"{proxy} {op} {a_shape} TE Float8BlockQuantizer 1x128 (row + column): {te_ms:.3f} ms "
                  f"{nbytes / te_ms / 1e6:.0f} GB/s", flush=True)
            line += f", TE {te_ms:.3f}"
        summary.append(line)
        del a, b, a2, b2, expected, data, data_t, s, s_t, outputs, args, scratch, product_scratch
        torch.cuda.empty_cache()
    print("\n".join(["", "summary (medians, ms):"] + summary), flush=True)
    sys.stdout.flush()


main()
