"""Every cuBLASLt algorithm the heuristic offers for each block-scaled GEMM of the five proxies, timed.

fprop / dgrad: a (M, K) in 1x128 blocks times b (N, K) in 128x128 blocks, BF16 out (what F.scaled_mm runs);
wgrad: both in 1x128 blocks, FP32 out, beta = 1 (recipes.fp8.cublaslt). Prints, per GEMM, the heuristic's first
algorithm's time, the fastest one's and its index, and whether the fastest one's output equals the first's.
"""

import ctypes
import json
import sys

import torch
import torch.nn.functional as F

from recipes.fp8 import cublaslt as lt

CUDA_R_16BF = 14
SCALE_BLK128 = 5
MODELS = {  # tokens, hidden, qkv out, attention out, ffn, fc1 out
    "llama3_8b": (8192, 4096, 6144, 4096, 14336, 28672),
    "llama3_70b": (8192, 8192, 10240, 8192, 28672, 57344),
    "llama31_405b": (8192, 16384, 18432, 16384, 53248, 106496),
    "nemotron4_15b": (4096, 6144, 8192, 6144, 24576, 24576),
    "nemotron4_340b": (4096, 18432, 21504, 18432, 73728, 73728),
}
REQUESTED = int(sys.argv[1]) if len(sys.argv) > 1 else 32


def gemms(t, h, q, a, f, f1):
    for name, (i, o) in {"qkv": (h, q), "proj": (a, h), "fc1": (h, f1), "fc2": (f, h)}.items():
        yield name, "fprop", t, o, i
        yield name, "dgrad", t, i, o
        yield name, "wgrad", o, i, t


def config(algo):
    lib = lt.library()
    lib.cublasLtMatmulAlgoConfigGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                                         ctypes.c_size_t, ctypes.c_void_p]
    out = {}
    for name, attr in (("id", 0), ("tile", 1), ("splitk", 2), ("swizzle", 4), ("custom", 5), ("stages", 6),
                       ("inner", 7), ("cluster", 8)):
        for size in (4, 2, 8):
            buf, written = ctypes.c_uint64(0), ctypes.c_size_t(0)
            if lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(buf), size,
                                                         ctypes.byref(written)) == 0:
                out[name] = buf.value
                break
    return out


def plans(m, n, k, kind):
    """Descriptors, layouts and up to REQUESTED heuristic results for one GEMM."""
    lib, dev = lt.library(), torch.cuda.current_device()
    desc = ctypes.c_void_p()
    lt._check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), lt.CUBLAS_COMPUTE_32F, lt.CUDA_R_32F), "desc")
    s = lib.cublasLtMatmulDescSetAttribute
    lt._set(s, desc, lt.DESC_TRANSA, ctypes.c_int32(lt.CUBLAS_OP_T))
    lt._set(s, desc, lt.DESC_TRANSB, ctypes.c_int32(lt.CUBLAS_OP_N))
    a_mode = SCALE_BLK128 if kind != "wgrad" else lt.SCALE_VEC128  # cuBLAS A is our b
    lt._set(s, desc, lt.DESC_A_SCALE_MODE, ctypes.c_int32(a_mode))
    lt._set(s, desc, lt.DESC_B_SCALE_MODE, ctypes.c_int32(lt.SCALE_VEC128))
    out_type = lt.CUDA_R_32F if kind == "wgrad" else CUDA_R_16BF
    layouts = []
    for dtype, rows, cols, ld in ((lt.CUDA_R_8F_E4M3, k, n, k), (lt.CUDA_R_8F_E4M3, k, m, k), (out_type, n, m, n),
                                  (out_type, n, m, n)):
        layout = ctypes.c_void_p()
        lt._check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, ld), "layout")
        layouts.append(layout)
    return desc, layouts


def heuristics(desc, layouts):
    lib, dev = lt.library(), torch.cuda.current_device()
    pref = ctypes.c_void_p()
    lt._check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
    lt._set(lib.cublasLtMatmulPreferenceSetAttribute, pref, lt.PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(lt.WORKSPACE_BYTES))
    results, found = (lt.HeuristicResult * REQUESTED)(), ctypes.c_int(0)
    lt._check(lib.cublasLtMatmulAlgoGetHeuristic(lt._handle(dev), desc, *layouts, pref, REQUESTED, results,
                                                 ctypes.byref(found)), "heuristic")
    return [results[i] for i in range(found.value) if results[i].state == 0]


def main():
    torch.manual_seed(0)
    dev = torch.cuda.current_device()
    rows = []
    for model, dims in MODELS.items():
        for layer, kind, m, n, k in gemms(*dims):
            a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
            b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
            sa = torch.exp2(torch.randint(-3, 3, (k // 128, m), device="cuda").float())  # (rows, K/128) col-major
            if kind == "wgrad":
                sb = torch.exp2(torch.randint(-3, 3, (k // 128, n), device="cuda").float())
                out = torch.zeros(m, n, device="cuda", dtype=torch.float32)
            else:
                sb = torch.exp2(torch.randint(-3, 3, (n // 128, -(-(k // 128) // 4) * 4), device="cuda").float())
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            desc, layouts = plans(m, n, k, kind)
            lt._set(lt.library().cublasLtMatmulDescSetAttribute, desc, lt.DESC_A_SCALE_POINTER, ctypes.c_void_p(sb.data_ptr()))
            lt._set(lt.library().cublasLtMatmulDescSetAttribute, desc, lt.DESC_B_SCALE_POINTER, ctypes.c_void_p(sa.data_ptr()))
            found = heuristics(desc, layouts)
            alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
            stream = torch.cuda.current_stream().cuda_stream

            def call(h):
                lt._check(lt.library().cublasLtMatmul(
                    lt._handle(dev), desc, ctypes.byref(alpha), b.data_ptr(), layouts[0], a.data_ptr(), layouts[1],
                    ctypes.byref(beta), out.data_ptr(), layouts[2], out.data_ptr(), layouts[3], ctypes.byref(h.algo),
                    lt._workspace(dev).data_ptr(), lt.WORKSPACE_BYTES, stream), "matmul")

            times, outputs = [], []
            for h in found:
                try:
                    call(h)
                except lt.CublasLtError:
                    times.append(float("inf")); outputs.append(None); continue
                torch.cuda.synchronize()
                outputs.append(out.clone() if len(outputs) == 0 else None)
                for _ in range(2):
                    call(h)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                samples = []
                for _ in range(7):
                    start.record(); call(h); end.record(); end.synchronize()
                    samples.append(start.elapsed_time(end))
                times.append(sorted(samples)[len(samples) // 2])
            best = min(range(len(times)), key=times.__getitem__)
            call(found[best]); torch.cuda.synchronize()
            same = bool(torch.equal(out, outputs[0])) if outputs and outputs[0] is not None else None
            flops = 2 * m * n * k
            row = {"model": model, "layer": layer, "kind": kind, "m": m, "n": n, "k": k, "algos": len(found),
                   "first_ms": times[0], "best_ms": times[best], "best_index": best, "best_equal_first": same,
                   "first_tflops": flops / times[0] / 1e9, "best_tflops": flops / times[best] / 1e9,
                   "first": config(found[0].algo), "best": config(found[best].algo),
                   "all_ms": [round(t, 4) for t in times]}
            rows.append(row)
            print(f"{model:15s} {layer:5s} {kind:5s} {m:6d}x{n:6d}x{k:6d} algos {len(found):2d} first {times[0]:8.3f} "
                  f"best {times[best]:8.3f} (#{best}, {times[best] / times[0]:.3f}) {row['first_tflops']:6.0f} -> "
                  f"{row['best_tflops']:6.0f} TF equal {same} first {row['first']} best {row['best']}", flush=True)
            del a, b, out, sa, sb
    json.dump(rows, open(sys.argv[2] if len(sys.argv) > 2 else "algos.json", "w"), indent=1)
    for model in MODELS:
        first = sum(r["first_ms"] for r in rows if r["model"] == model)
        best = sum(r["best_ms"] for r in rows if r["model"] == model)
        print(f"{model}: one layer and micro-batch, first {first:.2f} ms, best {best:.2f} ms ({best / first:.3f})")


if __name__ == "__main__":
    main()
