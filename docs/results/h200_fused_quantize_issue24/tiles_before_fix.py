"""Exploration script as run on the H200 for issue 24 (not part of the product or the suites), from the repo root:
`python3 docs/results/h200_fused_quantize_issue24/tiles_before_fix.py OUT_DIR`. "product" in its log is the kernel of
the working tree then (235744b plus the FP32 transpose and compare-and-select clamp, uncommitted): which tiles of
recipes.fp8.fused_quantize's producer kernel wrote the reference bytes, and where its time went. As run then; the kernel's signature has changed since (no out_t)."""
import json, os, statistics, sys, time
import torch, triton
import triton.language as tl
from recipes.fp8 import fused_quantize as fq
from recipes.fp8.kernels import _format_args, _to_fp8, _fp8_bits
from recipes.fp8.formats import E4M3
from recipes.fp8.activation_ops import OPS, reference_output
from recipes.fp8.current_scaling import cast_to_fp8, tensorwise_scale
sys.path.insert(0, "tests")
from fused_quantize_checks import op_inputs, same_fp8

_produced_tiles, _tile_amax_bits = fq._produced_tiles, fq._tile_amax_bits
out_dir = sys.argv[1]
log = open(os.path.join(out_dir, "diagnose.log"), "w")
def say(*a):
    s = " ".join(str(x) for x in a); print(s, flush=True); log.write(s + "\n"); log.flush()

@triton.jit
def _cast(y, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr, OUT: tl.constexpr, SOFTWARE: tl.constexpr, OLDCLAMP: tl.constexpr):
    if OLDCLAMP:
        y = tl.minimum(tl.maximum(y, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        if SOFTWARE:
            return _fp8_bits(y, MANTISSA, BIAS)
        return y.to(OUT, fp_downcast_rounding="rtne")
    return _to_fp8(y, FP8_MAX, MANTISSA, BIAS, OUT, SOFTWARE)

@triton.jit
def _variant(a, b, out, out_t, scale_ptr, amax_bits, partial, rows, cols, a_cols, b_cols, OP: tl.constexpr,
             MODE: tl.constexpr, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr, OUT: tl.constexpr,
             SOFTWARE: tl.constexpr, STORE_T: tl.constexpr, ATOMIC: tl.constexpr, TRANS32: tl.constexpr, OLDCLAMP: tl.constexpr,
             BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pr = tl.program_id(0); pc = tl.program_id(1)
    r = pr * BLOCK_R + tl.arange(0, BLOCK_R)
    c = pc * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    first, second = _produced_tiles(a, b, r, c, mask, cols, a_cols, b_cols, OP, SOFTWARE)
    if MODE != 1:
        amax = _tile_amax_bits(first, mask)
        if OP == 3:
            amax = tl.maximum(amax, _tile_amax_bits(second, mask))
        if ATOMIC:
            tl.atomic_max(amax_bits, amax)
        else:
            tl.store(partial + pr * tl.num_programs(1) + pc, amax)
    if MODE != 0:
        scale = tl.load(scale_ptr)
        out_cols = 2 * cols if OP == 3 else cols
        v = first * scale
        q = _cast(v, FP8_MAX, MANTISSA, BIAS, OUT, SOFTWARE, OLDCLAMP)
        tl.store(out + r[:, None] * out_cols + c[None, :], q, mask=mask)
        if STORE_T:
            if TRANS32:
                tl.store(out_t + c[:, None] * rows + r[None, :], _cast(tl.trans(v), FP8_MAX, MANTISSA, BIAS, OUT, SOFTWARE, OLDCLAMP), mask=tl.trans(mask))
            else:
                tl.store(out_t + c[:, None] * rows + r[None, :], tl.trans(q), mask=tl.trans(mask))
        if OP == 3:
            v2 = second * scale
            q2 = _cast(v2, FP8_MAX, MANTISSA, BIAS, OUT, SOFTWARE, OLDCLAMP)
            tl.store(out + r[:, None] * out_cols + cols + c[None, :], q2, mask=mask)
            if STORE_T:
                if TRANS32:
                    tl.store(out_t + (cols + c)[:, None] * rows + r[None, :], _cast(tl.trans(v2), FP8_MAX, MANTISSA, BIAS, OUT, SOFTWARE, OLDCLAMP), mask=tl.trans(mask))
                else:
                    tl.store(out_t + (cols + c)[:, None] * rows + r[None, :], tl.trans(q2), mask=tl.trans(mask))

DEV = os.environ.get("DEV", "cuda")
SMOKE = DEV != "cuda"
from recipes.fp8.kernels import _bytes
def run_raw(op, a, b, mode, scale, amax, dtype, r, c, w, variant=None):
    opc = OPS.index(op); b2 = a if b is None else b
    cols, width = fq._widths(opc, a, b2); rows = a.shape[0]
    out = torch.empty((rows, width if mode else 0), dtype=dtype, device=DEV)
    out_t = torch.empty((width if mode else 0, rows), dtype=dtype, device=DEV)
    grid = (triton.cdiv(rows, r), triton.cdiv(cols, c))
    if variant is None:
        fn = lambda: fq._fp8_producer_kernel[grid](a, b2, _bytes(out), _bytes(out_t), scale, amax.view(torch.int32), rows, cols, a.shape[1], b2.shape[1], OP=opc, MODE=mode, **_format_args(dtype), BLOCK_R=r, BLOCK_C=c, num_warps=w)
    else:
        partial = torch.empty(grid[0] * grid[1], dtype=torch.int32, device=DEV)
        fn = lambda: _variant[grid](a, b2, _bytes(out), _bytes(out_t), scale, amax.view(torch.int32), partial, rows, cols, a.shape[1], b2.shape[1], OP=opc, MODE=mode, **_format_args(dtype), **variant, BLOCK_R=r, BLOCK_C=c, num_warps=w)
    return fn, out, out_t

def timed(fn, n=10):
    if SMOKE:
        fn(); return 1.0
    for _ in range(2): fn()
    ts = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))
    return statistics.median(ts)

t0 = time.time()
# 1. correctness of each tile, CAST mode (E4M3) and AMAX mode, on the GPU test's inputs
tiles = [(64, 64, 4), (64, 128, 4), (128, 64, 4), (64, 64, 8), (64, 64, 16), (32, 64, 4), (32, 32, 4), (32, 128, 8), (16, 128, 4), (128, 64, 8)]
say("== correctness per tile (rows x cols x warps): failures as op:shape:what")
good = []
for r, c, w in (tiles[:1] if SMOKE else tiles):
    fails = []
    for op in OPS:
        for rows, cols, awk in (((70, 100, True),) if SMOKE else ((70, 100, True), (257, 333, False), (8192, 1792, False))):
            a, b = op_inputs(op, rows, cols, DEV, seed=rows, awkward=awk)
            ref = reference_output(op, a, b)
            ref_amax = ref.abs().amax().float()
            finite = ref.float().nan_to_num(0.0, 0.0, 0.0).abs().amax()
            scale = tensorwise_scale(finite, E4M3)
            expected = cast_to_fp8(ref, scale, E4M3)
            amax = torch.zeros((), device=DEV)
            fn, _, _ = run_raw(op, a, b, 0, scale, amax, E4M3, r, c, w); fn()
            if not (torch.equal(amax.isnan(), ref_amax.isnan()) and torch.equal(amax.nan_to_num(), ref_amax.nan_to_num())):
                fails.append(f"{op}:{rows}x{cols}:amax")
            for vname, variant in (("product", None), ("fp8T", dict(STORE_T=True, ATOMIC=True, TRANS32=False, OLDCLAMP=False)),
                                   ("old", dict(STORE_T=True, ATOMIC=True, TRANS32=False, OLDCLAMP=True))):
                fn, out, out_t = run_raw(op, a, b, 1, scale, amax, E4M3, r, c, w, variant); fn()
                if not same_fp8(out, expected):
                    n = int((out.view(torch.uint8) != expected.view(torch.uint8)).sum())
                    fails.append(f"{vname}:{op}:{rows}x{cols}:rows({n})")
                if not same_fp8(out_t, expected.t().contiguous()):
                    n = int((out_t.view(torch.uint8) != expected.t().contiguous().view(torch.uint8)).sum())
                    fails.append(f"{vname}:{op}:{rows}x{cols}:transposed({n})")
    say(f"tile {r}x{c}x{w}: {'ok' if not fails else ' '.join(fails)}")
    if not any(f.startswith("product") for f in fails): good.append((r, c, w))
say("good tiles", good, f"{time.time()-t0:.0f}s")

# 2. where the time goes, at llama3_8b's shapes
T = 64 if SMOKE else 8192
F = 128 if SMOKE else 14336
cases = [("swiglu", (T, 2 * F), None, F), ("swiglu_backward", (T, F), (T, 2 * F), 2 * F), ("identity", (T, F // 4), None, F // 4)]
speed_tiles = [t for t in [(64, 64, 4), (64, 128, 4), (32, 128, 8), (64, 64, 8), (32, 64, 4), (128, 64, 8), (16, 128, 4), (64, 128, 8)]]
copy_src = torch.empty(1 << (10 if SMOKE else 28), dtype=torch.uint8, device=DEV); copy_dst = torch.empty_like(copy_src)
copy = 2 * copy_src.numel() / timed(lambda: copy_dst.copy_(copy_src)) / 1e6
say(f"== speed (GB/s, copy {copy:.0f}); variants: std, noT (no transposed store), T32 (transpose before the cast), part (amax without atomics)")
results = []
for op, ash, bsh, width in cases:
    a = torch.randn(ash, device=DEV).bfloat16(); b = None if bsh is None else torch.randn(bsh, device=DEV).bfloat16()
    nread = a.numel() * 2 + (0 if b is None else b.numel() * 2); nwrite = 2 * ash[0] * width
    scale = torch.ones((), device=DEV); amax = torch.zeros((), device=DEV)
    for r, c, w in (speed_tiles[:1] if SMOKE else speed_tiles):
        row = {}
        for name, mode, variant, nbytes in (
                ("amax", 0, None, nread), ("amax_part", 0, dict(STORE_T=True, ATOMIC=False, TRANS32=False, OLDCLAMP=False), nread),
                ("cast", 1, None, nread + nwrite), ("cast_noT", 1, dict(STORE_T=False, ATOMIC=True, TRANS32=False, OLDCLAMP=False), nread + nwrite // 2),
                ("cast_fp8T", 1, dict(STORE_T=True, ATOMIC=True, TRANS32=False, OLDCLAMP=False), nread + nwrite)):
            try:
                fn, _, _ = run_raw(op, a, b, mode, scale, amax, E4M3, r, c, w, variant)
                ms = timed(fn)
                row[name] = (round(ms, 3), round(nbytes / ms / 1e6))
            except Exception as ex:
                row[name] = ("err", str(ex)[:80])
        say(f"{op} {r}x{c}x{w}: " + "  ".join(f"{k} {v[0]}ms {v[1]}GB/s" for k, v in row.items()))
        results.append(dict(op=op, tile=(r, c, w), **{k: v for k, v in row.items()}))
say(f"done {time.time()-t0:.0f}s")
json.dump(results, open(os.path.join(out_dir, "diagnose.json"), "w"), indent=0)
