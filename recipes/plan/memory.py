"""Per-GPU memory of a run, estimated before launch: weights, gradients, optimizer states, activations."""

from __future__ import annotations

import math
from dataclasses import dataclass

from recipes.config import Config, Engine, GradReduce, Recipe, Recompute
from recipes.fp8 import Fp8Training
from recipes.models.loss import CHUNK_ELEMENTS, chunk_rows
from recipes.plan.parallel import data_parallel_size, world_size


@dataclass
class MemoryEstimate:
    """Per-GPU bytes on the busiest GPU: the torch engine's whole model, or 1/N of it under FSDP2; megatron-core's
    first pipeline stage, with the output layer's logits added."""

    weights: float
    gradients: float
    optimizer: float
    activations: float  # with the configured parallel.recompute
    activations_full_recompute: float  # what parallel.recompute=full would leave

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations


# Bytes per parameter of (weights, gradients, optimizer states).
#   torch engine: FP32 master weights are the model's weights; FP32 gradients; two FP32 Adam moments.
#   megatron-core: BF16 weights (FP8 with fp8_param_gather), a BF16 gradient buffer (main_grad; FP32 with
#   megatron.grad_reduce_in_fp32=true), and FP32 master weights + two moments in the optimizer, which the
#   distributed optimizer shards over data parallel (16 bytes per parameter become 4 + 12 / DP; 18 and 6 + 12 / DP
#   with the FP32 buffer; Megatron-FSDP shards all three).
TORCH_BYTES = (4.0, 4.0, 8.0)
MEGATRON_BYTES = (2.0, 2.0, 12.0)


def activation_bytes_per_token_layer(cfg: Config) -> tuple[float, float]:
    """Bytes one token leaves saved for the backward in one layer: (replicated over TP ranks, split over them).

    The two norm inputs and the residual (3h) are replicated over TP ranks unless sequence parallelism splits
    them; Q, K, V (q + 2kv), the attention output and its softmax statistics (2q), fc1's output and the
    activation (fc1 + f) are split. The torch engine's FP8 recipes save the four GEMM inputs once more in FP8
    (1 byte); Transformer Engine saves the FP8 copy instead of the BF16 one, which is counted here as BF16 (an upper
    bound). Selective recompute drops the attention output and statistics.
    """
    m = cfg.model
    q, kv = m.num_attention_heads * m.kv_channels, m.num_query_groups * m.kv_channels
    fc1 = 2 * m.ffn_hidden_size if m.activation.value == "swiglu" else m.ffn_hidden_size
    attention_core = 0 if cfg.parallel.recompute == Recompute.selective else 2 * q
    norms_and_residual = 2.0 * 3 * m.hidden_size
    split = 2.0 * (q + 2 * kv + attention_core + fc1 + m.ffn_hidden_size)
    if cfg.precision.recipe != Recipe.bf16 and cfg.engine == Engine.torch:
        norms_and_residual += 2 * m.hidden_size
        split += q + m.ffn_hidden_size
    return norms_and_residual, split


def estimate_memory(cfg: Config, parameters: int) -> MemoryEstimate:
    """Weights, gradients and optimizer states of the busiest GPU's share of the model, and the activations it
    keeps for the backward (approximate: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models", with flash attention and GQA).

    With pipeline parallelism the first stage keeps activations of min(pp, micro-batches) micro-batches of its
    num_layers / pp layers, x (1 + (pp - 1) / (pp x vp)) with the interleaved schedule. The logits (BF16 and FP32
    for the loss: 6 bytes per vocabulary entry, split over TP) live on the last stage and are added as an
    upper bound.
    """
    if cfg.engine == Engine.torch:
        return _torch_engine_memory(cfg, parameters)
    m, p = cfg.model, cfg.parallel
    embedding = m.vocab_size * m.hidden_size
    per_layer = (parameters - 2 * embedding) / m.num_layers  # final norm counted into the layers: negligible
    stage_layers = math.ceil(m.num_layers / p.pp)
    stage_parameters = (stage_layers * per_layer + embedding * (2 if p.pp == 1 else 1)) / p.tp
    weight_bytes, grad_bytes, optimizer_bytes = MEGATRON_BYTES
    if cfg.precision.recipe != Recipe.bf16 and cfg.precision.fp8_param_gather:
        weight_bytes = 1.0
    if cfg.engine == Engine.megatron and cfg.megatron.grad_reduce_in_fp32:
        grad_bytes = 4.0  # NeMo's gradient buffer is BF16 always: grad_reduce_in_fp32=False (recipes.nemo.mapping)
    shards = data_parallel_size(cfg) * p.cp  # megatron's data-parallel group for optimizer states includes CP
    if p.fsdp:
        weight_bytes, grad_bytes = weight_bytes / shards, grad_bytes / shards
    if p.distributed_optimizer or p.fsdp:
        optimizer_bytes /= shards

    tokens = cfg.trainer.micro_batch_size * m.seq_length / p.cp
    replicated, split = activation_bytes_per_token_layer(cfg)
    sp = p.sequence_parallel
    per_layer_activations = tokens * ((replicated / p.tp if sp else replicated) + split / p.tp)
    layer_input = tokens * 2.0 * m.hidden_size / (p.tp if sp else 1)  # all that full recompute keeps per layer
    micro_batches = cfg.trainer.global_batch_size // (cfg.trainer.micro_batch_size * data_parallel_size(cfg))
    in_flight = min(p.pp, micro_batches) * (1 + (p.pp - 1) / (p.pp * p.vp) if p.vp > 1 else 1)
    logits = tokens * 6.0 * m.vocab_size / p.tp
    kept = stage_layers * in_flight
    no_recompute = kept * per_layer_activations + logits
    full_recompute = kept * layer_input + per_layer_activations + logits  # plus the one layer being recomputed
    activations = full_recompute if p.recompute == Recompute.full else no_recompute
    return MemoryEstimate(
        weight_bytes * stage_parameters,
        grad_bytes * stage_parameters,
        optimizer_bytes * stage_parameters,
        float(activations),
        float(full_recompute),
    )


def _torch_engine_memory(cfg: Config, parameters: int) -> MemoryEstimate:
    """FP32 master weights and gradients, two FP32 Adam moments, and the tensors saved for the backward
    (activation_bytes_per_token_layer, no tensor parallelism).

    Over N > 1 processes (FSDP2) each holds 1/N of the weights, gradients and moments, plus the BF16 weights
    all-gathered at a time (the root's embedding and output layer, a layer and the next one prefetched); with
    gradient accumulation the whole model's FP32 gradients are accumulated unsharded until the last
    micro-batch's reduce-scatter, unless trainer.grad_reduce=per_micro_batch. FP8 layers under accumulation keep
    their weights quantized (and transposed) for the step: 2 bytes per linear weight, unless FSDP2 all-gathers
    them in FP8 (then a gathered layer weighs 1 byte per weight and nothing is cached). With activation
    checkpointing only each layer's input (h) is kept, and one layer's tensors at a time.
    """
    m, t = cfg.model, cfg.trainer
    per_token_layer = sum(activation_bytes_per_token_layer(cfg))
    tokens = t.micro_batch_size * m.seq_length
    # The fused loss holds one chunk's BF16 logits and their gradient, and the output layer's input gradient.
    logits = (4.0 * chunk_rows(tokens, m.vocab_size, CHUNK_ELEMENTS) * m.vocab_size + 2.0 * tokens * m.hidden_size
              if t.fused_loss else tokens * 6.0 * m.vocab_size)
    checkpointed = tokens * (m.num_layers * 2.0 * m.hidden_size + per_token_layer) + logits
    activations = checkpointed if t.activation_checkpointing else tokens * m.num_layers * per_token_layer + logits
    weights, gradients, optimizer = (b * parameters for b in TORCH_BYTES)
    dp = world_size(cfg)
    accumulates = t.global_batch_size > t.micro_batch_size * dp
    fp8 = Fp8Training.for_run(cfg, dp)
    if dp > 1:
        root = 2 * m.vocab_size * m.hidden_size
        layer_bytes = 1.0 if fp8.gathers_weights_in_fp8 else 2.0  # FP8 all-gather: one byte a weight
        gathered = 2.0 * root + layer_bytes * 2 * (parameters - root) / m.num_layers
        unsharded = accumulates and t.grad_reduce == GradReduce.per_step
        # The sharded gradients exist only from the last micro-batch's reduce-scatter to the optimizer step, while
        # the unsharded ones are freed layer by layer: the peak is the larger of the two.
        weights, optimizer = weights / dp + gathered, optimizer / dp
        gradients = gradients if unsharded else gradients / dp
    if fp8.caches_weights:
        weights += 2.0 * (parameters - 2 * m.vocab_size * m.hidden_size)  # the FP8 weight caches
    return MemoryEstimate(weights, gradients, optimizer, float(activations), float(checkpointed))
