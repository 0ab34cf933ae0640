"""Kernel names from real H200 profiles (ours: Inductor's fused kernels, cuBLAS; Transformer Engine's) land in the
category a reader of the time split expects."""

import pytest

from recipes.profiling import kernel_category


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
])
def test_kernel_categories(name, category):
    assert kernel_category(name) == category


def test_a_step_s_optimizer_and_output_layer_with_the_loss_are_regions_of_the_split():
    """Operators under the optimizer's and the output layer + loss's ranges move there from their names'
    categories; nothing is lost or counted twice (CPU operator time here; on a GPU the kernels they launch)."""
    import dataclasses

    import torch
    from torch.profiler import ProfilerActivity, profile

    from recipes.config import TrainerConfig, load_option
    from recipes.engine.training import build_optimizer, optimizer_step
    from recipes.fp8 import Fp8Training
    from recipes.models.transformer import Transformer
    from recipes.profiling import time_split

    cfg = dataclasses.replace(load_option("model", "tiny_llama"), num_layers=1)
    model = Transformer(cfg, activation_dtype=torch.float32)
    model.init_weights(torch.Generator().manual_seed(0))
    fp8 = Fp8Training(load_option("precision", "bf16"))
    optimizer = build_optimizer(model, TrainerConfig(), torch.device("cpu"))
    tokens = torch.randint(0, cfg.vocab_size, (1, 33), generator=torch.Generator().manual_seed(0))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        optimizer_step(lambda _: model(tokens[:, :-1], tokens[:, 1:]), 1, model, fp8, optimizer, 1e-3, 1.0)
    split = time_split(prof, "cpu")
    assert split["ms"]["optimizer"] > 0 and split["ms"]["output_and_loss"] > 0
    operators = sum(e.self_cpu_time_total for e in prof.key_averages() if e.self_cpu_time_total > 0) / 1e3
    assert abs(split["total_ms"] - operators) < 1e-6 * operators
    assert all(ms >= -1e-9 for ms in split["ms"].values())
