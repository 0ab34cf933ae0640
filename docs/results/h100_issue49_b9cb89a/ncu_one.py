# One launch each of cuBLAS's and our CUTLASS-DSL block-scaled GEMM at 8192^3 (1x128 x 128x128) under ncu.
# From the repository root, as it ran (ncu.txt):
#   ncu --profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis
#     --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats
#     python3 docs/results/h100_issue49_b9cb89a/ncu_one.py 1x128_x_128x128 cutlass_1x128_x_128x128
#     cutlass_tma_scales_1x128_x_128x128 cutlass_multicast_1x128_x_128x128
import sys, torch
sys.path.insert(0, "scripts")
from gemm_bench import variants
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
g = variants(a, b, names=tuple(sys.argv[1:]) or ("1x128_x_128x128", "cutlass_1x128_x_128x128"))
for f in g.values():
    f(); f()
torch.cuda.synchronize()
torch.cuda.profiler.start()
for f in g.values():
    f()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
