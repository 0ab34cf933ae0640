"""Transformer Engine's decoder layers as a peer column of scripts/layer_bench.py (`--peer te`, `--peer te_megatron`).

The same block as recipes.models.transformer.TransformerBlock, built from `te.TransformerLayer`: pre-norm, fused
QKV projection with grouped-query attention, RoPE from the model's own frequency table (Llama 3.1 scaling
included), causal attention, no biases, no dropout; Llama with RMSNorm and SwiGLU, Nemotron-4 with LayerNorm1p
(`zero_centered_gamma`) and squared ReLU (`srelu`) on half of each head's dimensions. Attention in TE's and
Megatron's default layout, (seq, batch, heads, dim) (`sbhd`): the stack turns its (batch, seq, hidden) input into
(seq, batch, hidden) once at its edge, a free view at micro-batch 1, where `bshd` would copy every head's tensors.
Weights initialised like ours. FP8 through `te.autocast` with TE's own recipe objects; each micro-batch after the
first reuses the FP8 weights it cached (`is_first_microbatch`). Eager: TE's modules are not compiled.

Two ways to train them, each a set of columns:
- `te_*`: BF16 parameters, BF16 gradients summed over the micro-batches by autograd, AdamW on the BF16 parameters
  (TE's examples);
- `te_megatron_*`: as Megatron-LM trains TE's layers (`MegatronStyleTraining`): FP32 main gradients written inside
  TE's weight-gradient GEMMs, TE's FusedAdam with FP32 master weights, and FP8 primary weights where Megatron's
  preset all-gathers FP8 weights (conf/precision's fp8_param_gather: current and delayed scaling, MXFP8), built
  under TE's `quantized_model_init` and recast from the masters after each step as megatron-core's distributed
  optimizer does (`cast_masters_to_fp8`).
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from recipes.config import Activation, ModelConfig, Normalization, TrainerConfig, load_option
from recipes.models.transformer import rope_inverse_frequencies
from recipes.profiling import OPTIMIZER
from recipes.trainer.loop import NonFiniteError

# Column name: f"{peer}_{recipe}". Block scaling's other block layouts are columns only when asked for (--te-recipes).
TE_RECIPES = ("bf16", "current", "delayed", "blockwise", "mxfp8", "blockwise_1d1d")
DEFAULT_TE_RECIPES = TE_RECIPES[:5]
# Each TE recipe's conf/precision preset: Megatron's settings for it (the megatron_layer columns' whole precision;
# here whether the weights are FP8, and block scaling's blocks).
PRECISION_OPTIONS = {"bf16": "bf16", "current": "fp8_current", "delayed": "fp8_delayed",
                     "blockwise": "fp8_blockwise", "mxfp8": "mxfp8", "blockwise_1d1d": "fp8_blockwise_1d1d"}


def import_transformer_engine():
    """transformer_engine.pytorch, or a one-line error saying how to get it."""
    try:
        import transformer_engine.pytorch as te
    except ImportError as error:
        raise RuntimeError(f"--peer te needs Transformer Engine (pip install transformer-engine[pytorch]): {error}") from None
    return te


def te_recipe(name: str, column: str):
    """TE's recipe object for one of TE_RECIPES, as REFERENCE.md section 9 sets them; None for bf16. Refuses a
    recipe TE cannot run on this GPU (TE's own check, naming the column) rather than measure something else."""
    te = import_transformer_engine()
    from transformer_engine.common import recipe

    if name == "bf16":
        return None
    make, available = {
        "current": (lambda: recipe.Float8CurrentScaling(fp8_format=recipe.Format.HYBRID), te.is_fp8_available),
        "delayed": (lambda: recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=1024,
                                                  amax_compute_algo="max"), te.is_fp8_available),
        "blockwise": (lambda: block_scaling(recipe, name), te.is_fp8_block_scaling_available),
        "blockwise_1d1d": (lambda: block_scaling(recipe, name), te.is_fp8_block_scaling_available),
        "mxfp8": (lambda: recipe.MXFP8BlockScaling(fp8_format=recipe.Format.E4M3), te.is_mxfp8_available),
    }[name]
    ok, reason = available(return_reason=True)
    if not ok:
        raise RuntimeError(f"{column}: Transformer Engine cannot run this recipe here: {reason}")
    return make()


def block_scaling(recipe, name: str):
    """TE's Float8BlockScaling with the blocks of the TE recipe's preset (x/w/grad_block_scaling_dim), E4M3."""
    x, w, grad = block_dims(name)
    return recipe.Float8BlockScaling(fp8_format=recipe.Format.E4M3, x_block_scaling_dim=x, w_block_scaling_dim=w,
                                     grad_block_scaling_dim=grad)


def block_dims(recipe_name: str) -> tuple[int, int, int]:
    return load_option("precision", PRECISION_OPTIONS[recipe_name]).block_dims


def fp8_primary_weights(recipe_name: str) -> bool:
    """Whether Megatron keeps this recipe's weights in FP8 (its preset all-gathers FP8 weights: conf/precision)."""
    return recipe_name != "bf16" and load_option("precision", PRECISION_OPTIONS[recipe_name]).fp8_param_gather


def one_process_group(device: torch.device) -> dist.ProcessGroup:
    """The default process group, made for this one process where there is none: Megatron's data-parallel group of
    one GPU, over which its optimizer reduces the FP8 weights' amaxes (NCCL on CUDA, Gloo on a CPU). A local store
    on a port the OS picks as it binds."""
    if not dist.is_initialized():
        store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True)
        if device.type == "cuda":
            dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                                    device_id=torch.device("cuda", torch.cuda.current_device()))
        else:
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return dist.group.WORLD


def _normal(std: float) -> Callable[[torch.Tensor], None]:
    return lambda weight: nn.init.normal_(weight, 0.0, std)


class TeDecoderStack(nn.Module):
    """N `te.TransformerLayer`s laid out as our block; `forward(x, is_first_microbatch)` takes and returns (batch,
    seq, hidden), and runs the layers in (seq, batch, hidden). With `fuse_wgrad_accumulation`, each linear's weight
    gradient goes into its weight's `main_grad` (FP32) inside the GEMM: written in the first micro-batch, added to
    in the others. With `fp8_weights_recipe`, the linears' weights are that recipe's FP8 tensors (TE's
    `quantized_model_init`), with no BF16 copy."""

    def __init__(self, cfg: ModelConfig, fuse_wgrad_accumulation: bool = False, fp8_weights_recipe=None):
        super().__init__()
        te = import_transformer_engine()
        llama = cfg.normalization == Normalization.rmsnorm
        # The BF16 values each FP8 weight was cast from are kept (in host memory) for its FP32 master, as Megatron
        # keeps them: delayed scaling casts the first weights with a scale of 1
        fp8_weights = (te.quantized_model_init(enabled=True, recipe=fp8_weights_recipe,
                                               preserve_high_precision_init_val=True)
                       if fp8_weights_recipe is not None else contextlib.nullcontext())
        with fp8_weights:
            self.layers = nn.ModuleList(
                te.TransformerLayer(
                    hidden_size=cfg.hidden_size,
                    ffn_hidden_size=cfg.ffn_hidden_size,
                    num_attention_heads=cfg.num_attention_heads,
                    num_gqa_groups=cfg.num_query_groups,
                    kv_channels=cfg.kv_channels,
                    layernorm_epsilon=cfg.norm_eps,
                    hidden_dropout=0.0,
                    attention_dropout=0.0,
                    init_method=_normal(cfg.init_std),
                    output_layer_init_method=_normal(cfg.init_std / math.sqrt(2 * cfg.num_layers)),
                    layer_number=index + 1,
                    self_attn_mask_type="causal",
                    params_dtype=torch.bfloat16,
                    seq_length=cfg.seq_length,
                    micro_batch_size=1,
                    fuse_qkv_params=True,
                    fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                    bias=False,
                    normalization="RMSNorm" if llama else "LayerNorm",
                    zero_centered_gamma=cfg.normalization == Normalization.layernorm1p,
                    activation="swiglu" if cfg.activation == Activation.swiglu else "srelu",
                    attn_input_format="sbhd",
                    device="cuda",
                )
                for index in range(cfg.num_layers)
            )
        # TE's layout of the RoPE table: (seq, 1, 1, rotary_dim) angles, rotate-half, applied to each head's
        # first rotary_dim dimensions; from our frequencies so that Llama 3.1's scaling is the same.
        rotary_dim = int(cfg.kv_channels * cfg.rotary_percent)
        inv_freq = rope_inverse_frequencies(rotary_dim, cfg.rope_base, cfg.rope_scaling).cuda()
        angles = torch.outer(torch.arange(cfg.seq_length, device="cuda", dtype=torch.float32), inv_freq)
        self.register_buffer("rotary", torch.cat([angles, angles], dim=-1)[:, None, None, :], persistent=False)

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        x = x.transpose(0, 1)  # (seq, batch, hidden): with batch 1 the same memory, no copy
        for layer in self.layers:
            x = layer(x, rotary_pos_emb=self.rotary, is_first_microbatch=is_first_microbatch)
        return x.transpose(0, 1)


class MainGradients:
    """FP32 main gradients of `params`, as Megatron's DistributedDataParallel keeps them: TE's weight-gradient GEMMs
    write each linear's (`fuse_wgrad_accumulation`), and the gradients that come through autograd instead (the
    norms', in BF16) are folded in after each backward, as Megatron's gradient hooks do."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        # torch.zeros, not zeros_like: TE's FP8 parameters would answer zeros_like in their own way
        self.grads = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in params]
        for param, grad in zip(params, self.grads):
            param.main_grad = grad

    def backward(self, micro_batch_loss: Callable[[int], torch.Tensor], micro_batches: int) -> torch.Tensor:
        """Forward and backward of each micro-batch (`micro_batch_loss(i)`: micro-batch i's share of the step's
        loss); returns the step's loss."""
        total = torch.zeros((), device=self.grads[0].device)
        for micro in range(micro_batches):
            loss = micro_batch_loss(micro)
            loss.backward()
            self._fold_autograd_gradients(first=micro == 0)
            total += loss.detach()
        return total

    @torch.no_grad()
    def _fold_autograd_gradients(self, first: bool) -> None:
        for param in self.params:
            if param.grad is not None:  # a gradient the GEMM did not write (TE leaves those None)
                if first:
                    param.main_grad.copy_(param.grad)
                else:
                    param.main_grad.add_(param.grad)
                param.grad = None

    @torch.no_grad()
    def clip_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients to a total 2-norm of at most `max_norm`, as torch's clip_grad_norm_ (ours) does;
        returns the norm before."""
        norm = torch.nn.utils.get_total_norm(self.grads, foreach=True)
        torch._foreach_mul_(self.grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return norm


def weight_decay_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict]:
    """Weight decay on matrices, none on norms (1-D), as ours (recipes.engine.training.build_optimizer) and Megatron."""
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


class MegatronStyleTraining:
    """How Megatron-LM trains TE's layers, for the `te_megatron_*` columns: FP32 main gradients (MainGradients),
    clipped over all of them, then TE's FusedAdam (Megatron's optimizer class) with the hyper-parameters of
    `trainer`, in one of two ways:

    - BF16 weights: FusedAdam keeps the FP32 master weights itself (`master_weights`), as the 16 bits a BF16 weight
      lacks (`store_param_remainders`: the same FP32 values), reads the main gradients as `decoupled_grad`, and
      writes the BF16 weights in the same kernel: Megatron's precision-aware optimizer, with its defaults.
    - FP8 weights (TeDecoderStack's `fp8_weights_recipe`): FusedAdam over FP32 masters (`masters`), then each FP8
      weight cast from its master (`cast_masters_to_fp8`) and the others (the norms') copied from theirs:
      megatron-core's distributed optimizer with FP8 primary weights.

    `step` is one training step; `group` the (one-process) group the FP8 weights' amaxes are reduced over."""

    def __init__(self, model: nn.Module, trainer: TrainerConfig, group: dist.ProcessGroup):
        from transformer_engine.pytorch import QuantizedTensor
        from transformer_engine.pytorch.optimizers import FusedAdam

        self.trainer, self.group = trainer, group
        params = [p for p in model.parameters() if p.requires_grad]
        self.gradients = MainGradients(params)
        adam = dict(lr=trainer.lr, betas=(trainer.adam_beta1, trainer.adam_beta2), eps=trainer.adam_eps,
                    adam_w_mode=True)
        self.fp8_weights = [p for p in params if isinstance(p, QuantizedTensor)]
        # With FP8 weights, masters of every weight: the FP8 ones' (cast after each step), then the others' (copied)
        self.copied_weights = [p for p in params if not isinstance(p, QuantizedTensor)] if self.fp8_weights else []
        self.masters = [fp32_master(p) for p in self.fp8_weights + self.copied_weights]
        if self.fp8_weights:
            self.optimizer = FusedAdam(weight_decay_groups(self.masters, trainer.weight_decay), **adam)
        else:
            for param in params:
                param.decoupled_grad = param.main_grad  # .grad must have the BF16 parameter's dtype
            self.optimizer = FusedAdam(weight_decay_groups(params, trainer.weight_decay), **adam, master_weights=True,
                                       master_weight_dtype=torch.float32, use_decoupled_grad=True,
                                       store_param_remainders=True)

    def step(self, micro_batch_loss: Callable[[int], torch.Tensor], micro_batches: int) -> torch.Tensor:
        """Forward and backward of each micro-batch, clipping, the update; the step's loss. Raises NonFiniteError,
        before the weights are touched, for an inf or NaN loss or gradient norm (one host sync, as ours)."""
        total = self.gradients.backward(micro_batch_loss, micro_batches)
        with record_function(OPTIMIZER), torch.no_grad():  # named in a profile's trace, as ours
            grad_norm = self.gradients.clip_(self.trainer.grad_clip)
            if not bool(torch.isfinite(total) & torch.isfinite(grad_norm)):
                raise NonFiniteError(total.item(), grad_norm.item())
            self.optimizer.step()
            if self.fp8_weights:
                cast_masters_to_fp8(self.fp8_weights, self.masters[:len(self.fp8_weights)], self.group)
                torch._foreach_copy_(self.copied_weights, self.masters[len(self.fp8_weights):])
        return total


def fp32_master(param: nn.Parameter) -> nn.Parameter:
    """An FP32 master weight of `param` (of an FP8 weight, the BF16 values it was cast from: TeDecoderStack), whose
    gradient is the parameter's FP32 main gradient itself: the optimizer reads it in place."""
    if hasattr(param, "get_high_precision_init_val"):
        value = param.get_high_precision_init_val().to(param.device)
        param.clear_high_precision_init_val()
    else:
        value = param.detach()
    master = nn.Parameter(value.float().clone())
    master.grad = param.main_grad
    return master


def cast_masters_to_fp8(weights: list[torch.Tensor], masters: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Each FP32 master into its FP8 weight, as megatron-core 0.16's distributed optimizer does after its step
    (fp8_utils.quantize_param_shard): TE's cast_master_weights_to_fp8 with each whole master at offset 0 (one
    data-parallel rank holds every shard), scales from the masters' amaxes reduced over `group`, the weights'
    transposes left alone (manual_post_all_gather_processing), then made from the whole weights
    (post_all_gather_processing, which Megatron runs after its all-gather). The per-tensor casts run row-wise only
    (recipes.megatron.master_cast, the fix engine=megatron installs for TE's fallback cast-transpose kernel)."""
    from transformer_engine.pytorch.tensor.utils import cast_master_weights_to_fp8, post_all_gather_processing

    from recipes.megatron.master_cast import rowwise_master_casts

    with rowwise_master_casts(weights):
        # flat, as megatron-core hands over its shards (TE casts each into a flat view of its weight)
        cast_master_weights_to_fp8(weights, [m.view(-1) for m in masters], [0] * len(weights), group,
                                   manual_post_all_gather_processing=True)
    post_all_gather_processing(weights)
