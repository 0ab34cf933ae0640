# Issue 49's kernels beside cuBLAS's at six shapes, through scripts/gemm_bench.py's own bench_shape; run from the
# repository root: python docs/results/h200_issue49_e5f8f31/gemm_quick.py OUT.json
import sys, json
sys.path.insert(0, "scripts")
from gemm_bench import bench_shape, model_gemm_shapes, PAIRS
names = ("bf16", "tensorwise", *PAIRS, *(f"triton_{p}" for p in PAIRS), *(f"cutlass_{p}" for p in PAIRS))
shapes = [("sweep", 8192, 8192, 8192)] + model_gemm_shapes("llama3_8b") + model_gemm_shapes("llama3_70b")[2:3]
rows = []
for shape in shapes:
    rows += bench_shape(*shape, warmup=5, repeats=20, names=names)
    json.dump(rows, open(sys.argv[1], "w"), indent=1)
