"""megatron-core's own decoder layers as a peer column of scripts/layer_bench.py (`--peer megatron_layer`): N
layers trained literally as Megatron-LM trains them.

The layers are megatron-core TransformerLayers in a TransformerBlock without the final norm (GPTModel's decoder as
a middle pipeline stage holds it), built from the config engine=megatron builds (recipes.megatron.translate): the
architecture of conf/model, the conf/precision preset of the column's TE recipe (FP8 primary weights where the
preset all-gathers FP8 weights: current and delayed scaling, MXFP8; megatron-core builds them under TE's FP8 model
init and runs each forward under its own FP8 autocast), cfg.megatron's fusions resolved against the kernels here,
and recipes.megatron.build's layer spec (Transformer Engine's; without TE megatron-core's local one, BF16 only).
RoPE from megatron-core's RotaryEmbedding as GPTModel makes it; activations (seq, batch, hidden).

Trained as engine=megatron trains its model, over a data-parallel group of this one process: megatron-core's
DistributedDataParallel (its gradient buffer in the precision of cfg.megatron.grad_reduce_in_fp32, the weight
gradients accumulated into it inside TE's GEMMs; the bench prints the column's settings), its no-pipelining
schedule (get_forward_backward_func: micro-batches, loss scaling by their number, gradient sync after the last),
and its distributed optimizer (get_megatron_optimizer: TE's FusedAdam on FP32 master shards, clipping, the masters
copied into BF16 weights or cast into FP8 ones, with engine=megatron's row-wise cast, recipes.megatron.master_cast).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch
from torch import nn
from torch.profiler import record_function

from recipes.config import Config, Engine, ModelConfig, TrainerConfig, load_option
from recipes.megatron import parallel_state
from recipes.megatron.build import configure, initialize_parallel_state
from recipes.megatron.engine import wrap
from recipes.megatron.translate import available_kernels, describe_tuning, gpt_model_kwargs, optimizer_config
from recipes.profiling import OPTIMIZER
from megatron.core.enums import ModelType
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock

# Sibling script: scripts/ is on sys.path.
from te_peer import PRECISION_OPTIONS, one_process_group


def megatron_config(model_cfg: ModelConfig, recipe: str, trainer: TrainerConfig, micro_batches: int) -> Config:
    """The run config engine=megatron would train these layers with: the bench's model and optimizer, the conf/precision
    preset of TE's `recipe`, micro-batches of one sequence, conf's defaults for the rest (megatron.*: NVIDIA's
    performance settings; parallel: one GPU with the distributed optimizer). The GPU, executor and data options are
    not read by the translation."""
    return Config(model=model_cfg, precision=load_option("precision", PRECISION_OPTIONS[recipe]),
                  gpu=load_option("gpu", "h200"), executor=load_option("executor", "local"),
                  data=load_option("data", "mock"), engine=Engine.megatron,
                  trainer=dataclasses.replace(trainer, micro_batch_size=1, global_batch_size=micro_batches))


class MegatronDecoder(MegatronModule):
    """GPTModel's decoder for a middle pipeline stage: `config.num_layers` TransformerLayers of `spec`, no final
    norm, RoPE as GPTModel computes it. `forward(x)` takes (batch, seq, hidden) and returns (seq, batch, hidden)."""

    def __init__(self, cfg: Config, config: TransformerConfig, spec: ModuleSpec):
        super().__init__(config=config)
        self.model_type = ModelType.encoder_or_decoder  # what megatron-core's schedules ask a model
        self.decoder = TransformerBlock(config, spec, post_layer_norm=False)
        rope = gpt_model_kwargs(cfg)
        rotary = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=rope["rotary_percent"],
                                 rotary_interleaved=config.rotary_interleaved, rotary_base=rope["rotary_base"],
                                 rope_scaling=rope["rope_scaling"], rope_scaling_factor=rope["rope_scaling_factor"],
                                 use_cpu_initialization=config.use_cpu_initialization)
        self.rotary_pos_emb = rotary(cfg.model.seq_length)  # GPTModel's forward gets the same table from its cache

    def set_input_tensor(self, input_tensor) -> None:
        self.decoder.set_input_tensor(input_tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (seq, batch, hidden): with batch 1 the same memory, no copy
        return self.decoder(x.transpose(0, 1), attention_mask=None, rotary_pos_emb=self.rotary_pos_emb)


class MegatronLayerTraining:
    """The layers of `cfg` built and wrapped as engine=megatron builds and wraps its model (module doc), computing in
    `compute` on `device`; `step(inputs)` is one training step over the step's micro-batch inputs (batch, seq,
    hidden), its loss each micro-batch's mean squared output (`loss_of`), as the other columns'."""

    def __init__(self, cfg: Config, device: torch.device, compute: torch.dtype,
                 loss_of: Callable[[torch.Tensor], torch.Tensor]):
        one_process_group(device)
        if not parallel_state.model_parallel_is_initialized():
            initialize_parallel_state(cfg)
        if device.type == "cuda":
            model_parallel_cuda_manual_seed(cfg.trainer.seed)
        else:
            torch.manual_seed(cfg.trainer.seed)
        kernels = available_kernels()
        spec_name = "Transformer Engine's layer spec" if kernels.transformer_engine else "megatron-core's local spec"
        self.description = f"{spec_name}; {describe_tuning(cfg, kernels)}"  # what the bench prints of the column
        config, spec = configure(cfg, device, compute)  # as engine=megatron configures its model
        decoder = MegatronDecoder(cfg, config, spec).to(device)
        (self.model,) = wrap(cfg, config, [decoder])
        self.optimizer = get_megatron_optimizer(optimizer_config(cfg, compute), [self.model])
        for group in self.optimizer.param_groups:  # a constant rate, as the other columns': no scheduler
            group["lr"] = cfg.trainer.lr
        self.forward_backward = get_forward_backward_func()
        self.seq_length = cfg.model.seq_length
        self.loss_of = loss_of

    def _forward_step(self, data_iterator, model: nn.Module):
        output = model(next(data_iterator))

        def loss_func(output_tensor: torch.Tensor):
            loss = self.loss_of(output_tensor)
            # A copy: the schedule divides the returned loss in place
            return loss, {"loss": loss.detach().clone()}

        return output, loss_func

    def step(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = self.forward_backward(forward_step_func=self._forward_step, data_iterator=iter(inputs),
                                       model=self.model, num_microbatches=len(inputs), seq_length=self.seq_length,
                                       micro_batch_size=1, forward_only=False)
        with record_function(OPTIMIZER):  # named in a profile's trace, as the engine names it
            self.optimizer.step()
        return torch.stack([loss["loss"] for loss in losses]).mean()
