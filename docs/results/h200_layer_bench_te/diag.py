"""Diagnostics: (1) which SDPA backend/time for llama3_8b's attention before and after importing TE;
(2) compiled update_delayed_scaling on CUDA: where the scale goes wrong."""
import sys, time
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, ".")
from recipes.config import AmaxComputeAlgo
from recipes.fp8 import delayed_scaling as ds
from recipes.fp8.formats import E4M3, E5M2

def sdpa_times(tag):
    q = torch.randn(1, 32, 8192, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 8, 8192, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 8, 8192, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for name, backends in [("default", None), ("cudnn", [SDPBackend.CUDNN_ATTENTION]), ("flash", [SDPBackend.FLASH_ATTENTION])]:
        try:
            def run():
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                y.sum().backward()
            ctx = sdpa_kernel(backends) if backends else torch.enable_grad()
            with ctx:
                for _ in range(3): run()
                torch.cuda.synchronize(); t = time.perf_counter()
                for _ in range(10): run()
                torch.cuda.synchronize()
            print(f"{tag} sdpa {name}: {(time.perf_counter() - t) / 10 * 1e3:.2f} ms fwd+bwd", flush=True)
        except Exception as e:
            print(f"{tag} sdpa {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    print(f"{tag} cudnn version {torch.backends.cudnn.version()} enabled {torch.backends.cudnn.enabled} "
          f"cudnn_sdp {torch.backends.cuda.cudnn_sdp_enabled()} flash_sdp {torch.backends.cuda.flash_sdp_enabled()}", flush=True)

def delayed(variant):
    states = [ds.DelayedScalingState(4).cuda(), ds.DelayedScalingState(4).cuda()]
    for s in states:
        s.amax_history[:, 0] = torch.tensor([1.0, 2.0, 3.0], device="cuda")
    fn = torch.compile(variant)
    fn(states, (E4M3, E4M3, E5M2), AmaxComputeAlgo.max, 1)
    print(variant.__name__, "scale", states[0].scale.tolist(), "hist", states[0].amax_history[:, -1].tolist(), flush=True)

def per_tensor_copies(states, role_dtypes, algo, margin):
    orig = torch._foreach_copy_
    try:
        torch._foreach_copy_ = lambda dst, src: [d.copy_(s) for d, s in zip(dst, src)]
        ds.update_delayed_scaling.__wrapped__(states, role_dtypes, algo, margin)
    finally:
        torch._foreach_copy_ = orig

sdpa_times("before TE")
for v in (ds.update_delayed_scaling, per_tensor_copies):
    try:
        delayed(v)
    except Exception as e:
        print(v.__name__, type(e).__name__, str(e)[:300], flush=True)
if len(sys.argv) > 1:
    import transformer_engine.pytorch as te
    sdpa_times("after TE")
