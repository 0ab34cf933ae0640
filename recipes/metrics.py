"""Per-step training metrics: what is counted, how, and where it is written.

Model FLOPs per token follow Megatron-LM's `num_floating_point_operations` for a dense GQA transformer, so our
TFLOP/s are comparable with Megatron's and NVIDIA's published figures:

    per layer:  6 * [ h * (q + 2 * kv)          QKV projection
                    + q * h                     output projection
                    + m * h * f ]               MLP (m = 3 for SwiGLU, 2 for squared ReLU)
              + 6 * q * s                       QK^T and (QK^T)V, half of each counted (causal mask)
    plus        6 * h * V                       output layer (logits)

with h hidden, f ffn, q = heads * head_dim, kv = groups * head_dim, s sequence length, V vocabulary. The factor 6
is 2 FLOPs per multiply-add times 3 GEMMs (fprop, dgrad, wgrad). Recomputation is not counted (model FLOPs).

MFU divides model TFLOP/s by the GPU's dense BF16 datasheet peak for every recipe, FP8 included, so MFU ratios
between recipes equal their speedups. On a CPU there is no published peak and MFU is null.

Steady state: `summary.json` holds medians over the steps after the first `warmup_steps(n)` of n steps
(10%, at least 1: the first step includes compilation and allocator warm-up).

Where every step goes (`MetricsWriter`, one place for both engines): `metrics.jsonl`, TensorBoard scalars
(`trainer.tensorboard`, tags `train/<field>`) and W&B (`logger.wandb.project`). megatron-core (0.16) has no writer
of its own: its `Timers.write` and MoE loss tracking take the caller's `torch.utils.tensorboard.SummaryWriter`,
which Megatron-LM creates as this module does.

The run's files are written as recipes.folders writes (never through a link planted under their names), and a
write that fails for want of room (a full disk, a quota, `ulimit -f`) stops the run in one line naming the cause and
the fix (WriteFailed), as does the run directory itself disappearing (RunDirGone).
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import os
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

from recipes.config import Activation, Config, ConfigError, ModelConfig, Normalization, module_assignment, to_dict
from recipes.folders import open_append, write_file
from recipes.run_files import METRICS, SUMMARY, TENSORBOARD


def flops_per_token(model: ModelConfig, include_output_layer: bool = True, causal: bool = True) -> float:
    """Model FLOPs per token of one training step. causal=False counts the whole S x S attention matrix, the
    convention of PaLM's MFU and torchtitan (their TFLOP/s are higher for the same step time)."""
    h, f, s = model.hidden_size, model.ffn_hidden_size, model.seq_length
    q = model.num_attention_heads * model.kv_channels
    kv = model.num_query_groups * model.kv_channels
    mlp_matrices = 3 if model.activation == Activation.swiglu else 2
    attention = 6 * q * s if causal else 12 * q * s
    per_layer = 6 * (h * (q + 2 * kv) + q * h + mlp_matrices * h * f) + attention
    logits = 6 * h * model.vocab_size if include_output_layer else 0
    return float(model.num_layers * per_layer + logits)


def count_parameters(model: ModelConfig) -> int:
    """The model's parameters, exactly those recipes.models.transformer builds (and megatron-core's GPTModel;
    tests/test_models.py checks both): per layer the fused QKV projection h * (q + 2 * kv), the output projection
    q * h, the MLP m * h * f (m as in flops_per_token) and two norms (RMSNorm: a weight; LayerNorm1p: a weight and
    a bias); plus the untied embedding and output layer (V * h each) and the final norm."""
    h, f = model.hidden_size, model.ffn_hidden_size
    q = model.num_attention_heads * model.kv_channels
    kv = model.num_query_groups * model.kv_channels
    mlp_matrices = 3 if model.activation == Activation.swiglu else 2
    norm = h if model.normalization == Normalization.rmsnorm else 2 * h
    per_layer = h * (q + 2 * kv) + q * h + mlp_matrices * h * f + 2 * norm
    return model.num_layers * per_layer + 2 * model.vocab_size * h + norm


def warmup_steps(num_steps: int) -> int:
    return max(1, num_steps // 10)


@dataclass
class StepMetrics:
    step: int
    loss: float
    grad_norm: float
    lr: float
    step_time_s: float
    tokens_per_s_per_gpu: float
    model_tflops_per_gpu: float
    mfu: Optional[float]
    peak_memory_gib: float


def step_metrics(
    cfg: Config, step: int, loss: float, grad_norm: float, lr: float, step_time_s: float, world_size: int, peak_memory_gib: float
) -> StepMetrics:
    tokens_per_gpu = cfg.trainer.global_batch_size * cfg.model.seq_length / world_size
    tflops = tokens_per_gpu * flops_per_token(cfg.model) / step_time_s / 1e12
    peak = cfg.gpu.peak_tflops_bf16
    return StepMetrics(
        step=step,
        loss=loss,
        grad_norm=grad_norm,
        lr=lr,
        step_time_s=step_time_s,
        tokens_per_s_per_gpu=tokens_per_gpu / step_time_s,
        model_tflops_per_gpu=tflops,
        mfu=tflops / peak if peak else None,
        peak_memory_gib=peak_memory_gib,
    )


def check_loggers(cfg: Config) -> None:
    """The loggers the config asks for can start in this Python; ConfigError naming the fix otherwise."""
    if cfg.trainer.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("trainer.tensorboard=true needs the tensorboard package (a dependency of this project: "
                          "pip install tensorboard), or set trainer.tensorboard=false")
    if cfg.logger.wandb.project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"logger.wandb.project={cfg.logger.wandb.project} needs wandb, which this Python lacks: "
                          "pip install wandb, or leave logger.wandb.project unset")


# ---- writes that fail ----

FULL = (errno.ENOSPC, errno.EDQUOT)
MEANINGS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is used up",
    errno.EFBIG: "file too large for the file-size limit (ulimit -f) or the filesystem",
    errno.EROFS: "the filesystem is read-only",
}


class WriteFailed(ConfigError):
    """A file of the run could not be written (a full disk, a quota, a file-size limit, a read-only filesystem):
    not a bug to trace but a state of the machine, said in one line with its cause and what to do."""


def write_failure(error: OSError) -> str:
    """What an OSError of a write means, with its errno's name, e.g. "no space left on the device (ENOSPC)"."""
    name = errno.errorcode.get(error.errno, str(error.errno))
    return f"{MEANINGS.get(error.errno, error.strerror or str(error))} ({name})"


def write_fix(error: OSError, elsewhere: str) -> str:
    """What lets the write through: room where the disk or quota is full, a larger file-size limit, or a folder
    that takes it; `elsewhere` names the setting that moves the file ("give this run another run.dir")."""
    if error.errno in FULL:
        return f"free space there, or {elsewhere} with room"
    if error.errno == errno.EFBIG:
        return f"raise the file-size limit (ulimit -f), or {elsewhere} on a filesystem that takes larger files"
    return f"{elsewhere} that can be written"


class RunDirGone(ConfigError):
    """The run directory was removed, moved or replaced while the run trained.

    The run stops rather than make the folder again. The run directory is the run's record: config.yaml, the lock,
    metrics.jsonl, its checkpoints. Made anew, it would hold the steps from here on without the config or the steps
    before them, which a report would read as a whole run; and where the folder was moved, the run would go on in
    two places. Stopping leaves one record, which a moved run continues from its newest checkpoint (run.dir set to
    its new place)."""

    def __init__(self, run_dir: Path, how: str = "removed or moved"):
        super().__init__(f"run dir {run_dir} disappeared during the run ({how}): its record (config.yaml, "
                         f"{METRICS}, checkpoints) is not there any more, so the run stops rather than start a "
                         "half run dir in its place; if it was moved, the same command with run.dir set to its new "
                         "place resumes from its newest checkpoint")


def _folder_identity(path: Path) -> Optional[tuple[int, int]]:
    """(device, inode) of a folder, None when it is gone: the same folder still, not just one of the same name."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return None
    return found.st_dev, found.st_ino


class MetricsWriter:
    """Every step's metrics, written by the logging process: a JSON line in `<run dir>/metrics.jsonl` and
    TensorBoard scalars in `<run dir>/tensorboard/` (both flushed, so a crash loses nothing written), and a W&B
    run, as the config asks. `first_step` > 1 is a resumed run: TensorBoard hides what a crashed attempt logged
    from that step on, as metrics.jsonl drops it; `history` is what metrics.jsonl holds of the steps before.

    metrics.jsonl is the run's record: the writer keeps every line it holds, and a file removed, replaced or cut
    short while the run trains is noticed at the next step and written again whole, with one line saying so. The
    run directory removed, moved or replaced is noticed too, and stops the run (RunDirGone); a write that fails
    (a full disk) stops it with WriteFailed."""

    def __init__(self, run_dir: Path, cfg: Config, first_step: int = 1, history: Sequence[StepMetrics] = ()):
        check_loggers(cfg)
        self.run_dir, self.path = run_dir, run_dir / METRICS
        self._run_dir_identity = _folder_identity(run_dir)
        self._lines = [json.dumps(asdict(m)) + "\n" for m in history]
        self._failed = False
        self._file = open_append(self.path)
        self._bytes = self._file.tell()
        self._tensorboard = None
        if cfg.trainer.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(run_dir / TENSORBOARD),
                                              purge_step=first_step if first_step > 1 else None)
        self._wandb = _start_wandb(cfg, run_dir) if cfg.logger.wandb.project else None

    def write(self, metrics: StepMetrics) -> None:
        self._check_run_dir()
        record = asdict(metrics)
        line = json.dumps(record) + "\n"
        self._lines.append(line)
        scalars = {f"train/{key}": value for key, value in record.items() if key != "step" and value is not None}
        try:
            self._append(line)
            if self._tensorboard is not None:
                for tag, value in scalars.items():
                    self._tensorboard.add_scalar(tag, value, metrics.step)
                self._tensorboard.flush()  # on disk every step, as metrics.jsonl: a killed run keeps what it logged
        except OSError as error:
            self._failed = True
            raise WriteFailed(
                f"cannot write the metrics of step {metrics.step} into {self.run_dir}: {write_failure(error)}; the "
                f"steps before it are recorded. To go on, {write_fix(error, 'move the run directory to a folder')}; "
                "the same command resumes from the newest checkpoint") from None
        if self._wandb is not None:
            self._wandb.log(scalars, step=metrics.step)

    def _check_run_dir(self) -> None:
        """RunDirGone unless the run directory is still the folder the run started in."""
        found = _folder_identity(self.run_dir)
        if found != self._run_dir_identity:
            raise RunDirGone(self.run_dir, "removed or moved" if found is None else "replaced by another folder")

    def _append(self, line: str) -> None:
        """`line` onto metrics.jsonl, or the whole file written again where it was lost since the last step."""
        lost = self._lost()
        if lost:
            self._rewrite(lost)
        else:
            self._file.write(line)
            self._file.flush()
            self._bytes += len(line.encode())

    def _lost(self) -> str:
        """What happened to metrics.jsonl since the last write ("": nothing)."""
        try:
            found = os.stat(self.path)
        except FileNotFoundError:
            return "removed"
        own = os.fstat(self._file.fileno())
        if (found.st_dev, found.st_ino) != (own.st_dev, own.st_ino):
            return "replaced"
        return "cut short" if found.st_size < self._bytes else ""

    def _rewrite(self, lost: str) -> None:
        """metrics.jsonl written again from every line the run has logged, replacing whatever is there at once."""
        self._file.close()
        write_file(self.path, "".join(self._lines))
        self._file = open_append(self.path)
        self._bytes = self._file.tell()
        print(f"warning: {self.path} was {lost} during the run; written again from the run's own record "
              f"({len(self._lines)} steps)", flush=True)

    def keep_copy(self, folder: Path) -> None:
        """metrics.jsonl as it is now, into a checkpoint folder: what a resume restores should the run directory's
        be lost (recipes.trainer.checkpoints.resume_metrics). Written whole or not at all. Called right after each
        save, it also notices a run directory gone meanwhile (a save would have made its checkpoint folder again)."""
        self._check_run_dir()
        try:
            write_file(folder / METRICS, "".join(self._lines))
        except OSError as error:
            raise WriteFailed(
                f"cannot copy {METRICS} into the checkpoint {folder}: {write_failure(error)}; the checkpoint itself "
                f"is complete. To go on, {write_fix(error, 'set trainer.checkpoint.dir to a folder')}; the same "
                "command resumes from the newest checkpoint") from None

    def close(self) -> None:
        try:
            self._file.close()
            if self._tensorboard is not None:
                self._tensorboard.close()
        except OSError:
            if not self._failed:  # after a failed write, what it could not write fails again: said already
                raise
        if self._wandb is not None:
            self._wandb.finish()


def _start_wandb(cfg: Config, run_dir: Path):
    import wandb

    settings = cfg.logger.wandb
    run_id = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]  # a resumed run continues its W&B run
    return wandb.init(project=settings.project, entity=settings.entity, name=settings.name or cfg.run.name,
                      dir=str(run_dir), id=run_id, resume="allow", config=to_dict(cfg))


def summarize(cfg: Config, history: list[StepMetrics], world_size: int, extra: dict) -> dict:
    """Steady-state medians (after warm-up) and the run's identity, for `<run dir>/summary.json`."""
    skip = warmup_steps(len(history))
    steady = history[skip:] or history

    def median(field: str) -> Optional[float]:
        values = [getattr(m, field) for m in steady if getattr(m, field) is not None]
        return statistics.median(values) if values else None

    return {
        "model": cfg.model.name,
        "parameters": count_parameters(cfg.model),
        "precision": cfg.precision.name,
        "recipe": cfg.precision.recipe.value,
        "gpu": cfg.gpu.name,
        "engine": cfg.engine.value,
        "world_size": world_size,
        "nodes": cfg.executor.nodes,
        "num_layers": cfg.model.num_layers,
        "seq_length": cfg.model.seq_length,
        "micro_batch_size": cfg.trainer.micro_batch_size,
        "global_batch_size": cfg.trainer.global_batch_size,
        "steps": len(history),
        "warmup_steps_excluded": skip,
        "median_step_time_s": median("step_time_s"),
        "tokens_per_s_per_gpu": median("tokens_per_s_per_gpu"),
        "model_tflops_per_gpu": median("model_tflops_per_gpu"),
        "mfu": median("mfu"),
        "peak_memory_gib": max(m.peak_memory_gib for m in history),
        "final_loss": history[-1].loss,
        "emulated": cfg.precision.emulate,
        "modules": module_assignment(cfg.precision, cfg.model.num_layers),  # each linear's precision option
        **extra,
    }


def write_summary(run_dir: Path, summary: dict) -> None:
    if not run_dir.is_dir():
        raise RunDirGone(run_dir)
    try:
        write_file(run_dir / SUMMARY, json.dumps(summary, indent=2) + "\n")
    except OSError as error:
        raise WriteFailed(f"cannot write {run_dir / SUMMARY}: {write_failure(error)}; every step is in {METRICS}. "
                          f"To write it, {write_fix(error, 'move the run directory to a folder')}") from None
