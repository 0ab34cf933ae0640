"""Static SASS count per element of each op and mode of recipes.fp8.fused_quantize's producer kernel, compiled on the
CPU for sm_90a by Triton 3.6.0 (the H200's version; pip install triton==3.6.0 in a venv of its own, with torch on
PYTHONPATH), 16x128 tile, 4 warps (16 elements per thread). Run from the repo root; not part of the suites."""
import sys, subprocess, re, os
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from recipes.fp8 import fused_quantize as fq
from recipes.fp8.kernels import _format_args
import torch
sig = {"a": "*bf16", "b": "*bf16", "out": "*fp8e4nv", "scale_ptr": "*fp32", "amax_bits": "*i32",
       "rows": "i32", "cols": "i32", "a_cols": "i32", "b_cols": "i32"}
bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
for op in (0, 1, 2, 3, 4):
    for mode in (1, 2, 0):
        R, C, W = 16, 128, 4
        dt = torch.float8_e5m2 if op >= 3 or op == 0 else torch.float8_e4m3fn
        fa = _format_args(dt); fa["SOFTWARE"] = False
        sig["out"] = "*fp8e5" if dt == torch.float8_e5m2 else "*fp8e4nv"
        const = {**fa, "OP": op, "MODE": mode, "BLOCK_R": R, "BLOCK_C": C}
        attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 5, 6, 7, 8)}
        src = ASTSource(fq._fp8_producer_kernel, {**sig, **{n: "constexpr" for n in const}}, constexprs=const, attrs=attrs)
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": W})
        open("/tmp/k.cubin", "wb").write(c.asm["cubin"])
        sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", "/tmp/k.cubin"], capture_output=True, text=True).stdout
        ins = [l for l in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", l)]
        kinds = {}
        for l in ins:
            m = re.search(r"\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)", l)
            if m:
                k = m.group(2).split(".")[0]; kinds[k] = kinds.get(k, 0) + 1
        per_thread = R * C // (32 * W)
        top = sorted(kinds.items(), key=lambda x: -x[1])[:8]
        print(fq.OPS[op], ["amax", "cast", "record"][mode], f"{len(ins)} SASS, {len(ins)/per_thread:.1f}/element", top, flush=True)
