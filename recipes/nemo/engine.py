"""The NeMo engine: the run as NeMo 2's own pretraining recipe for the model, built and trained inside the NeMo
container by the NeMo installed there.

    torchrun --nproc-per-node=N -m recipes.nemo.engine RUN_DIR/config.yaml

Reads only the resolved YAML written by `launch/run.py`. It checks that this NeMo can run the precision, builds
`nemo.collections.llm.recipes.<model>.pretrain_recipe(performance_mode=True)` with this NeMo, writes the run's
config over it (recipes.nemo.mapping: layout, batch, sequence, steps, learning rate, data, checkpoints, the
precision plugin as NVIDIA's performance scripts set it), saves it as RUN_DIR/nemo_recipe.yaml, and runs it in
this process, one per GPU (torchrun), as NeMo's own launches do. NeMo prints its iteration line
(`Training epoch 0, iteration 99/999 | lr: ... | reduced_train_loss: ... | train_step_timing in s: ...`) and a
callback writes metrics.jsonl and summary.json (recipes.nemo.callback), so reports read this engine as the others.
Importing this module imports no NeMo.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch

from recipes.config import Config, ConfigError, DataKind
from recipes.nemo.preflight import check_versions
from recipes.run_files import NEMO_RECIPE
from recipes.trainer.checkpoints import own_checkpoint_dir
from recipes.trainer.entry import engine_main


def train(cfg: Config, run_dir: Path) -> dict:
    if importlib.util.find_spec("nemo") is None:
        raise ConfigError(f"engine=nemo runs inside the NeMo container, and this Python ({sys.executable}) has no "
                          "NeMo: submit with executor=slurm and executor.slurm.container_image set to a NeMo 2 image")
    import fiddle as fdl

    from recipes.nemo import build

    check_versions(cfg, *build.versions())
    if not torch.cuda.is_available():
        raise ConfigError("engine=nemo needs CUDA GPUs: NeMo's recipes train with Transformer Engine on GPUs")
    own_checkpoint_dir(cfg, run_dir)  # every rank, before NeMo's process group: each checks, one claims
    recipe = build.build_recipe(cfg, run_dir, data_prefix(cfg))
    if int(os.environ.get("RANK", 0)) == 0:
        (run_dir / NEMO_RECIPE).write_text(build.to_yaml(recipe))
        print(f"nemo recipe: {run_dir / NEMO_RECIPE}", flush=True)
    fdl.build(recipe)()
    return {}


def data_prefix(cfg: Config) -> str | None:
    """The indexed dataset's prefix: data.path, or the bundled corpus (built on first use); None for data=mock."""
    if cfg.data.kind == DataKind.mock:
        return None
    from recipes.data.corpus import build_corpus  # megatron-core's indexed dataset: imported once NeMo is known
    from recipes.data.index_check import existing_prefix

    return existing_prefix(cfg.data.path) if cfg.data.path else build_corpus(cfg.data.cache_dir)


def main(argv: list[str] | None = None) -> int:
    return engine_main("recipes.nemo.engine", train, argv, stops_on_signals=False)  # Lightning's and NeMo's own


if __name__ == "__main__":
    sys.exit(main())
