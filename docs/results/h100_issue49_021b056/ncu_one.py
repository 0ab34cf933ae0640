# One launch each of cuBLAS's and our CUTLASS-DSL block-scaled GEMM at 8192^3 (1x128 x 128x128) under ncu.
# From the repository root, as it ran: ncu --profile-from-start off --set full --import-source no python3 docs/results/h100_issue49_021b056/ncu_one.py
# (ncu.txt: the same with --section SpeedOfLight, ComputeWorkloadAnalysis, MemoryWorkloadAnalysis, WarpStateStats,
# SchedulerStats, Occupancy, LaunchStats)
import sys, torch
sys.path.insert(0, "scripts")
from gemm_bench import variants
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
g = variants(a, b, names=("1x128_x_128x128", "cutlass_1x128_x_128x128"))
for f in g.values():
    f(); f()
torch.cuda.synchronize()
torch.cuda.profiler.start()
for f in g.values():
    f()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
