# Issue 49's CUTLASS-DSL kernel (the variants named in argv[2], else all four) beside cuBLAS at ten shapes, through
# scripts/gemm_bench.py's own bench_shape: the forward shapes of docs/results/h200_issue49_e5f8f31/gemm_quick.py and
# llama3_8b's weight-gradient shapes (K = tokens). From the repository root:
# python docs/results/h100_issue49_66fd8f5/gemm_quick.py OUT.json [KERNEL,KERNEL...]
import sys, json
sys.path.insert(0, "scripts")
from gemm_bench import bench_shape, model_gemm_shapes, PAIRS
kernels = sys.argv[2].split(",") if len(sys.argv) > 2 else ("cutlass", "cutlass_multicast", "cutlass_tma_scales", "cutlass_multicast_tma_scales")
names = ("bf16", "tensorwise", *PAIRS, *(f"{k}_{p}" for k in kernels for p in PAIRS))
fwd = [("sweep", 8192, 8192, 8192)] + model_gemm_shapes("llama3_8b") + model_gemm_shapes("llama3_70b")[2:3]
wgrad = [(f"{label}/wgrad", n, k, m) for label, m, n, k in model_gemm_shapes("llama3_8b")]
rows = []
for shape in fwd + wgrad:
    rows += bench_shape(*shape, warmup=5, repeats=20, names=names)
    json.dump(rows, open(sys.argv[1], "w"), indent=1)
