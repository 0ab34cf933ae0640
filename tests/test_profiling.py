"""Kernel names from real H200 profiles (ours: Inductor's fused kernels, cuBLAS; Transformer Engine's) land in the
category a reader of the time split expects."""

import datetime

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from recipes.profiling import (
    QUEUED_GAP_US, describe_telemetry, gpu_idle, gpu_telemetry, kernel_category, summarize_telemetry, time_split,
    window_telemetry,
)


@pytest.mark.parametrize("name, category", [
    ("nvjet_sm90_qqtst_192x192_128x4_2x1_v_bz_coopB_TNN", "gemm"),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "gemm"),
    ("aten::_scaled_mm", "gemm"),
    ("fp8_recipes::block_scaled_mm", "gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_1x4x1_cga1x1x1_kernel0_0", "attention"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    # Inductor names a kernel after what it fuses: these feed FP8 GEMMs (quantization), not GEMMs themselves.
    ("triton_poi_fused__scaled_mm__to_copy_abs_add_clamp_clone_div_eq_full_like_isinf_mul_ne_ones_like_reciprocal_t_", "quantization"),
    ("triton_red_fused__to_copy_abs_amax_bitwise_and_block_scaled_mm_cat_clamp_div_eq_full_like_gt_isinf_mul_ne_ones", "quantization"),
    ("_fp8_transpose_kernel", "quantization"),  # recipes.fp8.kernels
    ("void transformer_engine::detail::cast_transpose_kernel<float, __nv_fp8_e4m3>", "quantization"),
    ("triton_poi_fused_cat_mul_silu_silu_backward_split_view_4", "other"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul> >", "other"),
    # The loss: Transformer Engine's cross-entropy (engine=megatron), our fused loss's Inductor kernel, PyTorch's.
    ("cross_entropy_backward_kernel", "loss"),
    ("triton_red_fused__to_copy_arange_eq_exp_logsumexp_mul_ne_scalar_tensor_sub_unsqueeze_where_0", "loss"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous "
     "namespace)::LogSoftMaxForwardEpilogue>", "other"),
    ("aten::nll_loss_forward", "loss"),
    # Adam: Transformer Engine's (megatron-core's optimizer), PyTorch's fused AdamW.
    ("void multi_tensor_apply_kernel<TensorListMetadata<4, false>, transformer_engine::multi_tensor_adam::AdamFunctor"
     "<float, float, float, long>, int, float, float, float, float, float, float, adamMode_t, float>", "optimizer"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, false>>", "optimizer"),
])
def test_kernel_categories(name, category):
    assert kernel_category(name) == category


def test_time_split_counts_the_calls_of_each_kernel():
    """The split says how often each kernel (here: CPU operator) ran, so a profile shows where the launches go."""
    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            x = torch.mm(x, x).tanh()
        x.sum()
    split = time_split(prof, "cpu")
    called = {kernel["name"]: kernel["calls"] for kernel in split["most_called"]}
    assert called["aten::mm"] == called["aten::tanh"] == 5 and called["aten::sum"] == 1
    assert {kernel["name"]: kernel["calls"] for kernel in split["top_kernels"]}["aten::mm"] == 5


def test_gpu_idle_splits_queued_gaps_from_waits():
    # (start_us, end_us, name), out of order; "copy" runs on another stream inside "gemm", and "tail" starts
    # before "gemm" ends: neither leaves a gap.
    kernels = [
        (0.0, 100.0, "gemm"), (20.0, 40.0, "copy"), (90.0, 150.0, "tail"),
        (152.0, 160.0, "cast"),             # 2 us after tail: queued
        (660.0, 700.0, "adam"),             # 500 us after cast: the host
        (700.0 + QUEUED_GAP_US + 1, 720.0 + QUEUED_GAP_US, "norm"),  # just over the threshold: a wait too
    ]
    idle = gpu_idle(kernels)
    assert idle["kernels"] == 6
    assert idle["span_ms"] == pytest.approx((720.0 + QUEUED_GAP_US) / 1e3)
    assert idle["queued_gaps_ms"] == pytest.approx(2.0 / 1e3)
    assert idle["wait_gaps"] == 2
    assert idle["wait_gaps_ms"] == pytest.approx((500.0 + QUEUED_GAP_US + 1) / 1e3)
    longest = idle["longest_gaps"][0]
    assert (longest["after"], longest["before"]) == ("cast", "adam")
    assert longest["ms"] == pytest.approx(0.5) and longest["at_ms"] == pytest.approx(0.16)


def test_telemetry_summary_from_nvidia_smi_lines():
    """nvidia-smi's CSV for TELEMETRY_QUERY (noheader, nounits), as an H200 prints it: medians, and the share of
    samples where the power cap held the clock down; a refused query is reported, not parsed."""
    lines = "\n".join(["2026/12/03 14:11:52.100, 1980, 612.45, 700.00, 51, Not Active",
                       "2026/12/03 14:11:52.200, 1755, 699.80, 700.00, 54, Active",
                       "2026/12/03 14:11:52.300, 1830, 700.12, 700.00, 55, Active",
                       "2026/12/03 14:11:52.400, 1980, 205.10, 700.00, 49, Not Active", "garbled"])
    summary = summarize_telemetry(lines)
    timeline = summary.pop("timeline")
    assert summary == {"sm_clock_mhz": 1905.0, "power_w": 656.125, "power_limit_w": 700.0, "temperature_c": 52.5,
                       "power_capped_share": 0.5, "samples": 4}
    start = datetime.datetime(2026, 12, 3, 14, 11, 52, 150000).timestamp()  # nvidia-smi's local time
    assert [sample[1] for sample in timeline] == [1980, 1755, 1830, 1980]
    window = window_telemetry({"timeline": timeline}, start, start + 0.2)  # the second and third samples
    assert window["sm_clock_mhz"] == 1792.5 and window["samples"] == 2 and window["power_capped_share"] == 1.0
    assert window_telemetry({"timeline": timeline}, start + 1, start + 2) is None
    refused = 'Field "clocks_event_reasons.sw_power_cap" is not a valid field to query.\n'
    assert summarize_telemetry(refused) == {"unavailable": refused.strip()}
    assert "1905 MHz, 656 W of a 700 W limit" in describe_telemetry(summary) and "50%" in describe_telemetry(summary)


def test_telemetry_says_why_it_recorded_nothing_without_a_gpu():
    with gpu_telemetry(torch.device("cpu")) as telemetry:
        pass
    assert telemetry == {"unavailable": "not a CUDA device"}
    assert describe_telemetry(telemetry) == "GPU clock and power not recorded: not a CUDA device"


def test_a_sampler_printing_past_a_pipes_capacity_keeps_sampling_until_the_body_ends():
    """nvidia-smi's samples go to a file: in a pipe nobody reads, 64 KiB of them would block it mid-run."""
    import sys
    import time

    from recipes.profiling import sampler_output

    line = "2026/12/05 03:00:00.000, 1980, 650.0, 700.0, 50, Not Active"
    prints = f"import sys, time\nfor i in range(4000):\n    print(i, {line!r}, flush=True)\ntime.sleep(60)"
    with sampler_output([sys.executable, "-c", prints]) as output:
        time.sleep(3)  # the 4000 lines take a fraction of that
    lines = output["text"].splitlines()
    assert len(lines) == 4000 and lines[-1].startswith("3999 ")  # ~270 KiB, past any pipe's buffer
