"""The model asks SDPA for its attention kernels in its own order (recipes.models.attention), so what another
import does to PyTorch's global order (Transformer Engine's, in the NeMo container) does not change its kernel."""

from __future__ import annotations

import importlib
import sys

import torch
from torch.nn import functional as F

from recipes.config import load_option
from recipes.models.attention import CPU_ORDER, CUDA_ORDER, attention_kernel, describe_order
from recipes.models.transformer import Transformer

MATH_FIRST = [0, 1, 2, 3, 4]  # SDPBackend values: math, flash, efficient, cudnn, overrideable


def import_te_stand_in(tmp_path, monkeypatch) -> None:
    """A package named transformer_engine whose import, like the real one's on a GPU, changes which kernel SDPA
    picks by itself: it turns the flash kernel off and puts math first in PyTorch's global order (a CPU's SDPA
    reads only the former)."""
    package = tmp_path / "transformer_engine"
    package.mkdir()
    (package / "__init__.py").write_text("import torch\ntorch.backends.cuda.enable_flash_sdp(False)\n"
                                         f"torch._C._set_sdp_priority_order({MATH_FIRST})\n")
    assert "transformer_engine" not in sys.modules  # this CPU machine has no Transformer Engine
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("transformer_engine")


def default_choice(cfg) -> int:
    q = torch.empty(1, cfg.num_attention_heads, cfg.seq_length, cfg.kv_channels)
    kv = torch.empty(1, cfg.num_query_groups, cfg.seq_length, cfg.kv_channels)
    return torch._fused_sdp_choice(q, kv, kv, None, 0.0, True, scale=None, enable_gqa=True)


def test_the_order_names_cudnn_first_on_gpus_and_pytorchs_default_on_cpus():
    assert describe_order(True) == "cudnn, then flash, efficient, math"
    assert [b.value for b in CPU_ORDER] == torch._C._get_sdp_priority_order()[:4]  # PyTorch's own, on a CPU
    assert CUDA_ORDER[0].name == "CUDNN_ATTENTION"


def test_the_model_keeps_its_kernel_when_an_import_reorders_pytorchs_choice(tmp_path, monkeypatch):
    cfg = load_option("model", "tiny_llama")
    without = attention_kernel(cfg, torch.device("cpu"), torch.float32)
    previous = torch._C._get_sdp_priority_order()
    import_te_stand_in(tmp_path, monkeypatch)
    try:
        assert default_choice(cfg) == 0  # the stand-in works: left to itself, SDPA now picks math
        assert attention_kernel(cfg, torch.device("cpu"), torch.float32) == without == "flash"
        orders = []
        real_sdpa = F.scaled_dot_product_attention

        def recording_sdpa(*args, **kwargs):
            orders.append(torch._C._get_sdp_priority_order())
            return real_sdpa(*args, **kwargs)

        monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
        model = Transformer(cfg, activation_dtype=torch.float32)
        model(torch.zeros(1, 16, dtype=torch.long))
        assert orders == [[b.value for b in CPU_ORDER] + [4]] * cfg.num_layers
        assert torch._C._get_sdp_priority_order()[0] == 0  # the global order is back to math first
        assert not torch.backends.cuda.flash_sdp_enabled()
    finally:  # what the stand-in changed, undone for the tests after this one (which look for TE)
        torch._C._set_sdp_priority_order(previous)
        torch.backends.cuda.enable_flash_sdp(True)
        del sys.modules["transformer_engine"]


def test_the_plan_names_the_attention_order_and_the_loss_path(hydra_compose, tmp_path):
    from recipes.plan import make_plan
    from recipes.plan.describe import describe

    def kernels_line(*overrides) -> str:
        cfg = hydra_compose("data=mock", f"run.dir={tmp_path}", "dryrun=true", *overrides)
        return next(line for line in describe(make_plan(cfg, tmp_path / "config.yaml")).splitlines()
                    if line.startswith("kernels"))

    assert kernels_line("gpu=h200", "model=llama3_8b", "model.num_layers=1") == (
        "kernels     attention cudnn, then flash, efficient, math (SDPA, the first that runs); "
        "output layer + loss fused, in chunks (trainer.fused_loss)")
    assert kernels_line("gpu=cpu", "trainer.fused_loss=false") == (
        "kernels     attention flash, then efficient, math, cudnn (SDPA, the first that runs); "
        "output layer + loss from FP32 logits (trainer.fused_loss=false)")
