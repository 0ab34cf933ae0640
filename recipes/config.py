"""The run configuration: one typed schema shared by Hydra (at compose time) and the engines (at run time).

Hydra composes `conf/` into these dataclasses (see `recipes.hydra_schema`), so a typo, an unknown key or a wrong
type fails before anything launches. The launcher writes the resolved result to `<run dir>/config.yaml`; an
engine reads it back with `load_config`, which needs only PyYAML, so a GPU job needs neither Hydra nor nemo-run.
"""

from __future__ import annotations

import dataclasses
import enum
import fnmatch
import functools
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml


class Normalization(str, enum.Enum):
    rmsnorm = "rmsnorm"  # Llama 3
    layernorm1p = "layernorm1p"  # Nemotron-4: LayerNorm whose gamma is stored zero-centred (weight + 1)


class Activation(str, enum.Enum):
    swiglu = "swiglu"  # gated: silu(x W_gate) * (x W_up)
    squared_relu = "squared_relu"  # not gated: relu(x W_up) ** 2


class Recipe(str, enum.Enum):
    """Scaling recipes, named as megatron-core's `fp8_recipe` names them (bf16 = no FP8). Each FP8 recipe is the
    class of recipes.fp8.linear with its name, and the conf/precision option in the comment."""

    bf16 = "bf16"
    delayed = "delayed"  # DelayedScaling: fp8_delayed
    tensorwise = "tensorwise"  # TensorwiseScaling, per-tensor current scaling (TE's Float8CurrentScaling): fp8_current
    blockwise = "blockwise"  # BlockwiseScaling: fp8_blockwise
    mxfp8 = "mxfp8"  # MXFP8Scaling: mxfp8
    rowwise = "rowwise"  # RowwiseScaling, torchao's rowwise recipe (the torch engine only): fp8_rowwise(_gw_hp)
    nvfp4 = "nvfp4"  # Nvfp4Scaling, TE's NVFP4BlockScaling (megatron-core's fp4_recipe): nvfp4


class Fp8Format(str, enum.Enum):
    hybrid = "hybrid"  # E4M3 forward (activations, weights), E5M2 backward (gradients)
    e4m3 = "e4m3"  # E4M3 everywhere


class AmaxComputeAlgo(str, enum.Enum):
    max = "max"
    most_recent = "most_recent"


class Recompute(str, enum.Enum):
    """Activation recomputation (megatron-core's recompute_granularity): memory traded for a second forward."""

    none = "none"
    selective = "selective"  # core attention only: drops the largest per-token tensors for little extra compute
    full = "full"  # every layer keeps only its input and recomputes the rest in the backward


class GradReduce(str, enum.Enum):
    """When FSDP2 reduce-scatters gradients under gradient accumulation (several processes only)."""

    per_step = "per_step"  # once, after the last micro-batch: least traffic; FP32 gradients held unsharded until then
    per_micro_batch = "per_micro_batch"  # after every micro-batch (torchtitan's way): sharded gradients only


class Engine(str, enum.Enum):
    torch = "torch"  # recipes.engine.torch_engine: PyTorch-native models, the FP8 recipes of recipes/fp8, FSDP2
    megatron = "megatron"  # recipes.megatron.engine: megatron-core's models and parallelism, Transformer Engine's FP8
    nemo = "nemo"  # recipes.nemo.engine: NeMo 2's own pretraining recipe, built and run in the NeMo container


class ComputeDtype(str, enum.Enum):
    """What the engines compute in BF16 on a GPU: every GEMM but the FP8 ones, attention, the residual stream
    (recipes.compute)."""

    auto = "auto"  # bf16 on GPUs and on CPUs with native BF16 (AVX512 / AMX); fp32 on other CPUs (AVX2 only)
    bf16 = "bf16"
    fp32 = "fp32"  # PyTorch's BF16 GEMMs on a CPU without native BF16 are 20-40x slower than its FP32 ones


class ExecutorName(str, enum.Enum):
    local = "local"  # nemo-run's LocalExecutor: this machine (torchrun for several processes)
    slurm = "slurm"  # nemo-run's SlurmExecutor: one sbatch job per run (recipes.slurm)


class Tunnel(str, enum.Enum):
    """How executor=slurm reaches sbatch."""

    local = "local"  # this machine runs sbatch (a login node)
    ssh = "ssh"  # through a login node over SSH (executor.slurm.ssh, nemo-run's SSHTunnel)


class DataKind(str, enum.Enum):
    indexed = "indexed"  # a Megatron indexed dataset (.bin/.idx); the bundled text corpus when no path is given
    mock = "mock"  # uniformly random tokens: for throughput, not for loss curves


@dataclass
class RopeScaling:
    """Llama 3.1 frequency-dependent RoPE scaling."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class ModelConfig:
    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int  # head dimension
    vocab_size: int
    seq_length: int
    normalization: Normalization = Normalization.rmsnorm
    activation: Activation = Activation.swiglu
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    rotary_percent: float = 1.0  # fraction of each head's dimensions that RoPE rotates
    rope_scaling: Optional[RopeScaling] = None
    init_std: float = 0.02


# The linear layers of a decoder layer, named as the plan prints them (layers.{i}.<kind>), and the output layer.
LINEAR_KINDS = ("attention.qkv", "attention.out", "mlp.fc1", "mlp.fc2")
OUTPUT_LAYER = "output_layer"
# A module pattern: a glob over such names, and nothing a YAML file or a shell could read otherwise.
MODULE_PATTERN = re.compile(r"[A-Za-z0-9_.*?\[\]!-]+")


def linear_names(num_layers: int) -> list[str]:
    """Every linear layer's name, in the model's order: layers.0.attention.qkv ... output_layer."""
    return [f"layers.{i}.{kind}" for i in range(num_layers) for kind in LINEAR_KINDS] + [OUTPUT_LAYER]


def precision_of(name: str, precision: "PrecisionConfig", num_layers: int) -> str:
    """The conf/precision option of one linear: the first entry of precision.modules that matches its name; else
    bf16 in the layers num_layers_at_start/end_in_bf16 keep in BF16 and in the output layer (BF16 with the loss,
    as in Transformer Engine's recipes); else the run's precision."""
    for entry in precision.modules:
        if fnmatch.fnmatchcase(name, entry.pattern):
            return entry.precision
    match = re.fullmatch(r"layers\.(\d+)\..+", name)
    layer = int(match.group(1)) if match else None
    if layer is None or layer < precision.num_layers_at_start_in_bf16 \
            or layer >= num_layers - precision.num_layers_at_end_in_bf16:
        return "bf16"
    return precision.name


def module_assignment(precision: "PrecisionConfig", num_layers: int) -> dict[str, str]:
    """Every linear layer's conf/precision option (precision_of), by name."""
    return {name: precision_of(name, precision, num_layers) for name in linear_names(num_layers)}


def module_precision(run: "PrecisionConfig", option: str) -> "PrecisionConfig":
    """The precision a linear assigned `option` runs: the run's own (with its overrides) where `option` names it;
    else that conf/precision option's recipe and knobs, with the run's emulate and fused_kernels (run-wide
    settings) and no layers or modules of its own."""
    if option == run.name:
        return run
    return dataclasses.replace(load_option("precision", option), emulate=run.emulate, fused_kernels=run.fused_kernels,
                               num_layers_at_start_in_bf16=0, num_layers_at_end_in_bf16=0, modules=[])


def assigned_options(precision: "PrecisionConfig") -> list[str]:
    """The conf/precision options a run may give its linears: its own, those of precision.modules, and bf16."""
    return list(dict.fromkeys([precision.name, *(entry.precision for entry in precision.modules), "bf16"]))


def check_modules(precision: "PrecisionConfig", num_layers: int) -> None:
    """ConfigError, in one line, for an assignment of precisions to linears that cannot be what the user meant: a
    precision.modules pattern outside the glob grammar or matching no linear layer, an unknown conf/precision option,
    the output layer in FP8, more BF16 layers than the model has, an FP8 run that leaves every linear in BF16."""
    names = linear_names(num_layers)
    for index, entry in enumerate(precision.modules):
        where = f"precision.modules[{index}]"
        if not MODULE_PATTERN.fullmatch(entry.pattern):
            raise ConfigError(f"{where}.pattern={entry.pattern!r}: a pattern is a glob over linear names "
                              "(letters, digits, . _ - and * ? [ ] !), e.g. layers.*.mlp.fc2 or output_layer")
        if not any(fnmatch.fnmatchcase(name, entry.pattern) for name in names):
            raise ConfigError(f"{where}.pattern={entry.pattern!r} matches none of the model's linear layers "
                              f"({names[0]} ... {names[-2]}, {OUTPUT_LAYER})")
        load_option("precision", entry.precision)  # an unknown option: ConfigError listing the known ones
    bf16_layers = precision.num_layers_at_start_in_bf16 + precision.num_layers_at_end_in_bf16
    if bf16_layers > num_layers:
        raise ConfigError(f"precision.num_layers_at_start_in_bf16 + precision.num_layers_at_end_in_bf16 = "
                          f"{bf16_layers} is more than model.num_layers={num_layers}")
    assignment = module_assignment(precision, num_layers)
    if precision.recipe != Recipe.bf16 and all(option == "bf16" for option in assignment.values()):
        raise ConfigError(f"precision={precision.name} leaves every linear in BF16 (num_layers_at_start_in_bf16="
                          f"{precision.num_layers_at_start_in_bf16} and num_layers_at_end_in_bf16="
                          f"{precision.num_layers_at_end_in_bf16} of model.num_layers={num_layers}, precision.modules): "
                          "a run labelled with a recipe would train none of it; keep fewer layers in BF16, or use "
                          "precision=bf16")
    output = assignment[OUTPUT_LAYER]
    if output != "bf16" and load_option("precision", output).recipe != Recipe.bf16:
        raise ConfigError(f"precision.modules assigns {output} to {OUTPUT_LAYER}, which runs in BF16 in every "
                          "engine (fused with the loss); match only the decoder layers (layers.*)")


NVFP4_KNOBS = ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization")
DEFAULT_BLOCK_DIMS = (1, 2, 1)  # blockwise scaling's (input, weight, gradient) blocks: TE's Float8BlockScaling default


def gemms_of_two_2d_operands(block_dims: tuple[int, int, int]) -> list[str]:
    """The GEMMs of a linear whose two operands would both be in 128 x 128 blocks, for (input, weight, gradient)
    block dims (2: 128 x 128): no kernel takes that pair (cuBLAS on Hopper; Transformer Engine refuses it)."""
    x, w, grad = block_dims
    pairs = {"fprop (input x weight)": (x, w), "dgrad (gradient x weight)": (grad, w),
             "wgrad (gradient x input)": (grad, x)}
    return [gemm for gemm, dims in pairs.items() if dims == (2, 2)]


@dataclass
class ModulePrecision:
    """An entry of precision.modules: the linear layers whose names match `pattern`, a glob over the names the plan
    prints (layers.3.mlp.fc2, layers.*.attention.qkv, output_layer), run in `precision`, a conf/precision option."""

    pattern: str
    precision: str


@dataclass
class PrecisionConfig:
    name: str
    recipe: Recipe = Recipe.bf16
    fp8_format: Optional[Fp8Format] = None  # required for every recipe but bf16
    fp8_wgrad: bool = True  # False: the wgrad GEMM runs in BF16
    amax_history_len: int = 1024  # delayed scaling only
    amax_compute_algo: AmaxComputeAlgo = AmaxComputeAlgo.max  # delayed scaling only
    margin: int = 0  # delayed scaling only: scale = (fp8_max * 2**-margin) / amax
    num_layers_at_start_in_bf16: int = 0
    num_layers_at_end_in_bf16: int = 0
    # Blockwise scaling only, Transformer Engine's Float8BlockScaling knobs under their names: each operand's blocks,
    # 1 (1 x 128 along K) or 2 (128 x 128). The default (1, 2, 1) is TE's and DeepSeek-V3's.
    x_block_scaling_dim: int = 1  # a linear's input
    w_block_scaling_dim: int = 2  # its weight
    grad_block_scaling_dim: int = 1  # its output gradient
    # NVFP4 only, Transformer Engine's NVFP4BlockScaling knobs under their names: each part of NVIDIA's recipe is on
    # unless disabled (recipes.fp8.nvfp4).
    disable_rht: bool = False  # the random Hadamard transform of the weight gradient's operands
    disable_stochastic_rounding: bool = False  # stochastic rounding of output gradients
    disable_2d_quantization: bool = False  # 16 x 16 weight blocks (1 x 16 when disabled)
    fp8_param_gather: bool = False  # all-gather FP8 weights (sharded engines only)
    # Per-module precision, in order, the first match winning over num_layers_at_start/end_in_bf16 (shorthands for
    # bf16 entries) and over the run's own precision (module_assignment).
    modules: list[ModulePrecision] = field(default_factory=list)
    emulate: bool = False  # allow a recipe without native kernels on this GPU to run emulated (labelled as such)
    # On CUDA: Triton kernels for FP8 transposes and blockwise quantization, and for one process BF16 weights cast
    # once per optimizer step and weight gradients accumulated in FP32 inside the GEMM. false: PyTorch ops and
    # autograd's own accumulation, as before (same recipe; for comparisons).
    fused_kernels: bool = True

    @property
    def nvfp4_parts_disabled(self) -> list[str]:
        """The NVFP4 knobs (disable_*) this config sets."""
        return [name for name in NVFP4_KNOBS if getattr(self, name)]

    @property
    def block_dims(self) -> tuple[int, int, int]:
        """(input, weight, gradient) block dimensions of blockwise scaling (x/w/grad_block_scaling_dim)."""
        return self.x_block_scaling_dim, self.w_block_scaling_dim, self.grad_block_scaling_dim


@dataclass
class ParallelConfig:
    """How engine=megatron splits the model over GPUs: world size = tp x pp x cp x dp (dp is what is left).

    conf/layout/published.yaml fills these (and the batch sizes and nodes) from NVIDIA's published layouts in
    conf/layouts.yaml; a value given on the command line wins. The torch engine runs data-parallel only.
    """

    tp: int = 1  # tensor parallel: each linear layer's weight split over tp GPUs
    pp: int = 1  # pipeline parallel: consecutive layers on pp GPUs
    vp: int = 1  # virtual pipeline: model chunks per pipeline rank (interleaved 1F1B schedule); 1: none
    cp: int = 1  # context parallel: each sequence split over cp GPUs
    sp: Optional[bool] = None  # sequence parallel (norms, dropout split along the sequence); None: on when tp > 1
    fsdp: bool = False  # Megatron-FSDP: parameters, gradients and optimizer states sharded over data parallel
    pp_embedding_loss_as_layers: bool = False  # the pipeline split counts the embedding and the loss as a layer each
    distributed_optimizer: bool = True  # optimizer states (and FP32 master weights) sharded over data parallel
    recompute: Recompute = Recompute.none

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1 if self.sp is None else self.sp


@dataclass
class MegatronConfig:
    """engine=megatron's kernel fusions and communication overlaps: the switches NVIDIA's performance recipes set
    (NeMo scripts/performance, Megatron-Bridge perf_recipes), named as megatron-core names them, defaulting to
    those recipes' values.

    A fusion left at None (auto) is on where its kernel can be loaded on the machine that builds the model
    (Transformer Engine; CUDA for the wgrad accumulation; Apex for megatron-core's local softmax) and off
    elsewhere; set true where that kernel is missing it fails before launch, or when the engine builds the model
    (recipes.megatron.translate resolves them; the plan shows the result).
    """

    # wgrad GEMMs accumulate into the main_grad buffer in place, every linear (TE's kernel in TE's layers; Apex's, or
    # recipes.megatron.wgrad without Apex, in megatron-core's own); auto: on with CUDA, off under Megatron-FSDP (NeMo)
    gradient_accumulation_fusion: Optional[bool] = None
    cross_entropy_loss_fusion: Optional[bool] = None  # Transformer Engine's fused cross-entropy over the vocabulary
    apply_rope_fusion: Optional[bool] = None  # Transformer Engine's fused rotary embedding
    bias_activation_fusion: Optional[bool] = None  # SwiGLU in one compiled kernel (none for squared ReLU)
    bias_dropout_fusion: Optional[bool] = None  # the residual add (with bias and dropout) in one compiled kernel
    masked_softmax_fusion: Optional[bool] = None  # Apex's softmax kernels in megatron-core's local attention
    overlap_grad_reduce: bool = True  # gradient reduction overlapped with the backward
    overlap_param_gather: bool = True  # sharded weights' all-gather overlapped with the forward (distributed optimizer)
    align_param_gather: Optional[bool] = None  # all pipeline stages start their all-gathers together; auto: with vp > 1
    # The gradient buffer and its reduction in BF16, as every NVIDIA performance recipe (Megatron-Bridge, NeMo
    # scripts/performance, Megatron-LM's --grad-reduce-in-bf16); true: FP32, like the torch engine's main gradients
    grad_reduce_in_fp32: bool = False
    tp_comm_overlap: bool = False  # Transformer Engine's userbuffers overlap TP communication with GEMMs (tp > 1, sp)
    cuda_graphs: bool = False  # megatron-core's per-layer CUDA graphs (cuda_graph_impl=local; NeMo: off on H100)
    # Bit-reproducible steps: Transformer Engine's deterministic attention backward (NVTE_ALLOW_NONDETERMINISTIC_ALGO
    # =0, megatron-core's deterministic_mode). Off, cuDNN's attention backward sums in a varying order: a repeated
    # step's gradients differ in the last bits (Megatron-LM's --deterministic-mode)
    deterministic: bool = False


@dataclass
class GpuConfig:
    name: str  # h100, h200, b200, gb200, cpu, or auto (detect at launch)
    arch: str  # hopper, blackwell, cpu
    compute_capability: Optional[float] = None
    peak_tflops_bf16: Optional[float] = None  # dense datasheet peak per GPU; None where no peak is published
    peak_tflops_fp8: Optional[float] = None
    memory_gb: Optional[float] = None  # datasheet memory per GPU
    gpus_per_node: int = 1


@dataclass
class SshTunnelConfig:
    """Submit from this machine to a cluster's login node over SSH (executor.slurm.tunnel=ssh, nemo-run's
    SSHTunnel). host, job_dir and repo are required then; every field is optional in the schema so that each can be
    set on its own on the command line (executor.slurm.ssh.host=...)."""

    host: Optional[str] = None  # the login node
    user: Optional[str] = None  # None: your user name here, as ssh does
    port: int = 22
    identity: Optional[str] = None  # private key file here; None: the SSH agent or ~/.ssh defaults
    job_dir: Optional[str] = None  # absolute, on the cluster's shared storage: job folders (experiments/), runs (runs/)
    repo: Optional[str] = None  # absolute path of this repository's checkout on the cluster: the job imports it
    python: Optional[str] = None  # the cluster's Python with torch; None: `python` (the container's, or on PATH)


@dataclass
class SlurmConfig:
    """sbatch/srun settings of executor=slurm (conf/executor/slurm.yaml)."""

    account: Optional[str] = None
    partition: Optional[str] = None
    time: str = "01:00:00"  # wall-clock limit, sbatch --time
    container_image: Optional[str] = None  # pyxis/enroot image; None: run on the nodes' own software
    container_mounts: list[str] = field(default_factory=list)  # SRC:DST; the repo and run root are added
    env_vars: dict[str, str] = field(default_factory=dict)  # exported in the job (values shell-quoted)
    gpu_env: dict[str, dict[str, str]] = field(default_factory=dict)  # gpu name -> variables for that GPU type
    secret_env: list[str] = field(default_factory=list)  # names passed from the submitting environment, never values
    mpi: str = "none"  # srun --mpi: none, pmix, pmi2 (what the cluster's Slurm supports)
    cpu_bind: Optional[str] = None  # srun --cpu-bind: none, cores, sockets, ... (None: the cluster's default)
    srun_args: list[str] = field(default_factory=list)  # further srun arguments
    exclusive: bool = False  # whole nodes
    mem: Optional[str] = None  # sbatch --mem, e.g. 0 (all of it) or 200G
    sbatch_args: dict[str, str] = field(default_factory=dict)  # any other sbatch option: {qos: high}
    tunnel: Tunnel = Tunnel.local
    ssh: SshTunnelConfig = field(default_factory=SshTunnelConfig)
    retries: int = 0  # resubmissions of a failed job (nemo-run max_retries)
    dependency: Optional[str] = None  # afterany, afterok, ...: each point of a -m sweep waits for the previous one


@dataclass
class ExecutorConfig:
    name: ExecutorName = ExecutorName.local
    gpus: int = 1  # processes per node: one per GPU (or CPU processes on a CPU-only machine)
    nodes: int = 1
    # Where nemo-run keeps its experiment records for every executor (and, on Slurm with the local tunnel, the jobs'
    # folders and logs: shared storage there); its CLI reads it as NEMORUN_HOME (recipes.nemo_run_home). Not
    # ".../nemo_run": nemo-run rewrites "/nemo_run" in the sbatch script of a job without container.
    nemo_run_home: str = "${run.root}/nemo-run"
    slurm: Optional[SlurmConfig] = None  # executor=slurm only


@dataclass
class DataConfig:
    name: str
    kind: DataKind = DataKind.indexed
    path: Optional[str] = None  # Megatron indexed dataset prefix (PREFIX.bin/.idx); None: the bundled corpus
    cache_dir: str = "~/.cache/fp8-recipes"


@dataclass
class CheckpointConfig:
    interval: int = 0  # save every `interval` optimizer steps and at the last step; 0: never
    keep_last: int = 2  # checkpoints kept on disk, newest first; 0: all
    dir: Optional[str] = None  # None: <run dir>/checkpoints; a relative path is taken from the run directory


@dataclass
class TrainerConfig:
    max_steps: int = 100
    micro_batch_size: int = 4
    global_batch_size: int = 8  # per optimizer step, over all processes (gradient accumulation fills the rest)
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 10
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 1234
    compile: Optional[bool] = None  # None: compile on GPU, not on CPU
    compute_dtype: ComputeDtype = ComputeDtype.auto  # what GPUs compute in BF16; fp32 is for CPUs (recipes.compute)
    activation_checkpointing: bool = False  # recompute each transformer block in the backward (saves memory)
    fused_loss: bool = True  # engine=torch: output layer + cross-entropy chunk by chunk, no whole logits (recipes.models.loss)
    grad_reduce: GradReduce = GradReduce.per_step  # FSDP2 with gradient accumulation: see GradReduce
    fsdp_fp8_all_gather: bool = False  # FSDP2 all-gathers per-tensor FP8 recipes' weights in FP8 (recipes.fp8.all_gather)
    log_interval: int = 10
    tensorboard: bool = True  # every step's metrics as TensorBoard scalars in <run dir>/tensorboard (recipes.metrics)
    profile_step: Optional[int] = None  # profile this step: RUN_DIR/profile/ trace + time split (recipes.profiling)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # resumes from the newest one found


@dataclass
class WandbConfig:
    project: Optional[str] = None  # a W&B project: every step's metrics go there too (needs `pip install wandb`)
    entity: Optional[str] = None  # the W&B team or user; None: wandb's default
    name: Optional[str] = None  # the W&B run's name; None: run.name


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class RunConfig:
    root: str = "runs"
    name: str = "${model.name}-${precision.name}"
    dir: str = "${run.root}/${now:%Y%m%d-%H%M%S}-${run.name}"
    # A run.dir holding a run with no checkpoint to continue from: true moves that run aside (recipes.plan.run_dir)
    # and starts this one there; false refuses the launch.
    overwrite: bool = False


@dataclass
class Config:
    model: ModelConfig
    precision: PrecisionConfig
    gpu: GpuConfig
    executor: ExecutorConfig
    data: DataConfig
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)  # engine=megatron only
    run: RunConfig = field(default_factory=RunConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    engine: Engine = Engine.torch
    dryrun: bool = False


# The config groups every run needs an option of (Config's fields without a default).
REQUIRED_GROUPS = tuple(f.name for f in dataclasses.fields(Config)
                        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the fix."""


# ---- the range of each numeric setting ----


# Numeric settings and the values they may take: (test, what the test says). A value outside is refused by
# check_values before anything else looks at it (a zero micro-batch would otherwise divide by zero in the checks).
AT_LEAST_1 = (lambda v: v >= 1, "at least 1")
NON_NEGATIVE = (lambda v: v >= 0, ">= 0")
POSITIVE = (lambda v: v > 0, "> 0")
BETA = (lambda v: 0 <= v < 1, "in [0, 1)")
SEED = (lambda v: 0 <= v < 2**32, "in [0, 2**32)")  # numpy's generators take no other
BLOCK_DIM = (lambda v: v in (1, 2), "1 (1 x 128 blocks) or 2 (128 x 128 blocks)")
DEFAULTS = {"trainer": TrainerConfig(), "executor": ExecutorConfig()}  # the groups whose fields have defaults
VALUE_RANGES = {
    **{f"model.{name}": AT_LEAST_1 for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                                                "num_query_groups", "kv_channels", "vocab_size", "seq_length")},
    "model.norm_eps": POSITIVE, "model.rope_base": POSITIVE, "model.init_std": POSITIVE,
    "model.rotary_percent": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "precision.amax_history_len": AT_LEAST_1,
    "precision.num_layers_at_start_in_bf16": NON_NEGATIVE, "precision.num_layers_at_end_in_bf16": NON_NEGATIVE,
    **{f"precision.{role}_block_scaling_dim": BLOCK_DIM for role in ("x", "w", "grad")},
    "trainer.max_steps": AT_LEAST_1, "trainer.micro_batch_size": AT_LEAST_1, "trainer.global_batch_size": AT_LEAST_1,
    "trainer.lr": NON_NEGATIVE, "trainer.min_lr": NON_NEGATIVE, "trainer.warmup_steps": NON_NEGATIVE,
    "trainer.weight_decay": NON_NEGATIVE, "trainer.adam_beta1": BETA, "trainer.adam_beta2": BETA,
    "trainer.adam_eps": POSITIVE, "trainer.grad_clip": POSITIVE, "trainer.log_interval": AT_LEAST_1,
    "trainer.seed": SEED, "trainer.checkpoint.interval": NON_NEGATIVE, "trainer.checkpoint.keep_last": NON_NEGATIVE,
    "executor.gpus": AT_LEAST_1, "executor.nodes": AT_LEAST_1,
}


def check_values(cfg: Config) -> None:
    """Every numeric setting finite and within its range (VALUE_RANGES), min_lr <= lr: one line naming the field
    and the range, with the default where it is valid. Cheap and needs nothing but the config: the plan calls it first, the engines on the config.yaml they read."""
    for name, (allowed, rule) in VALUE_RANGES.items():
        value = _field(cfg, name)
        if not (allowed(value) and math.isfinite(value)):  # inf passes >= 0; NaN passes no test
            group, rest = name.split(".", 1)
            default = _field(DEFAULTS[group], rest) if group in DEFAULTS else None
            hint = f"; e.g. {name}={default} (the default)" if default is not None and allowed(default) else ""
            raise ConfigError(f"{name}={value} is out of range: it must be {rule}{hint}")
    if cfg.trainer.min_lr > cfg.trainer.lr:
        raise ConfigError(f"trainer.min_lr={cfg.trainer.min_lr} is above trainer.lr={cfg.trainer.lr}: the learning rate "
                          "decays from lr to min_lr; set trainer.min_lr <= trainer.lr")


def _field(tree, name: str):
    return functools.reduce(getattr, name.split("."), tree)


# ---- reading and writing the resolved config (plain YAML, no Hydra) ----


def to_dict(cfg: Any) -> dict:
    """Plain, YAML-safe dict of a config dataclass (enums as their values)."""

    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, list):
            return [plain(item) for item in value]
        if isinstance(value, enum.Enum):
            return value.value
        return value

    return plain(cfg)


def from_dict(cls: type, data: dict, where: str = "") -> Any:
    """Build dataclass `cls` from a plain dict, rejecting unknown keys and values of the wrong type."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in '{where or 'config'}'; valid keys: {sorted(known)}")
    required = [f.name for f in dataclasses.fields(cls) if f.name not in data
                and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if required:
        raise ConfigError(f"'{where or 'config'}' lacks the required key(s) {required}")
    values = {name: _coerce(hints[name], value, f"{where}.{name}".lstrip(".")) for name, value in data.items()}
    return cls(**values)


def _coerce(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(hint):
            return None
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return _coerce(inner, value, where)
    if origin is list and dataclasses.is_dataclass(typing.get_args(hint)[0]):
        if not isinstance(value, list):
            raise ConfigError(f"'{where}' must be a list, got {value!r}")
        return [_coerce(typing.get_args(hint)[0], item, f"{where}[{index}]") for index, item in enumerate(value)]
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"'{where}' must be a mapping, got {value!r}")
        return from_dict(hint, value, where)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            raise ConfigError(f"'{where}' = {value!r}; valid values: {[m.value for m in hint]}") from None
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and not (isinstance(value, hint) and not (hint is int and isinstance(value, bool))):
        raise ConfigError(f"'{where}' must be {hint.__name__}, got {value!r}")
    return value


REPO_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = REPO_ROOT / "conf"


def load_option(group: str, name: str) -> Any:
    """One option of a conf/ group (conf/GROUP/NAME.yaml) as its dataclass, for tools that do not compose."""
    path = CONF_DIR / group / f"{name}.yaml"
    if not path.is_file():
        options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        raise ConfigError(f"no option '{name}' in conf/{group}; available: {', '.join(options)}")
    schema = typing.get_type_hints(Config)[group]
    return from_dict(schema, yaml.safe_load(_resolve_env(path.read_text())), group)


_OC_ENV = re.compile(r"""\$\{oc\.env:(\w+),\s*'?([^'}]*)'?\}""")


def _resolve_env(text: str) -> str:
    """OmegaConf's `${oc.env:NAME,default}`, the one interpolation an option file can resolve on its own (Hydra
    resolves it when composing; tools that load a single option do it here)."""
    return _OC_ENV.sub(lambda m: os.environ.get(m.group(1), m.group(2)), text)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def load_config(path: Path | str) -> Config:
    """The resolved config a launch wrote; ConfigError, naming the file, for one missing, unreadable or not a
    config (the engines' entry reads it first: recipes.trainer.entry)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        problem = error.strerror if isinstance(error, OSError) else f"not YAML: {str(error).splitlines()[0]}"
        raise ConfigError(f"cannot read the config {path} ({problem}); give the config.yaml that launch/run.py "
                          "wrote into a run directory (dryrun=true writes one)") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a config written by launch/run.py (it holds no mapping); "
                          "give the config.yaml of a run directory (dryrun=true writes one)")
    return from_dict(Config, data)
