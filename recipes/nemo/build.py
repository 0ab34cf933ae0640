"""NeMo's own pretraining recipe for the run, built by the NeMo of this Python (the container's, in the job), with
the run's fields (recipes.nemo.mapping) written over it.

Imports NeMo, which takes a minute: only the job (recipes.nemo.engine) and the NeMo tests import it.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any, Optional

import nemo_run as run
from nemo.collections import llm
from nemo.collections.common.tokenizers.null_tokenizer import NullTokenizer
from nemo.collections.llm.recipes.precision import mixed_precision

from recipes.config import Config, ConfigError, dump_config
from recipes.nemo.callback import RunMetrics
from recipes.nemo.mapping import (
    OPTIONAL_FIELDS, PRESETS, RECIPE_MODULES, data_module, recipe_fields, tokenizer_vocab_size,
)


def versions() -> tuple[str, str]:
    """(NeMo, megatron-core) as the packages themselves say (NeMo's containers install both from source)."""
    from megatron.core import package_info as megatron_core
    from nemo import package_info as nemo

    return nemo.__version__, megatron_core.__version__


def build_recipe(cfg: Config, run_dir: Path, data_prefix: Optional[str]) -> run.Partial:
    """`pretrain_recipe(performance_mode=True)` of the model, with the precision's plugin preset, the run's data
    and every field of recipe_fields; a RunMetrics callback writes the run's metrics. `data_prefix`: the indexed
    dataset (None for data=mock)."""
    module = importlib.import_module(f"nemo.collections.llm.recipes.{RECIPE_MODULES[cfg.model.name]}")
    recipe = module.pretrain_recipe(num_nodes=cfg.executor.nodes, num_gpus_per_node=cfg.executor.gpus,
                                    performance_mode=True)
    recipe.trainer.plugins = getattr(mixed_precision, PRESETS[cfg.precision.recipe].function)()
    tokenizer = run.Config(NullTokenizer, vocab_size=tokenizer_vocab_size(cfg))
    data_class, data_args = data_module(cfg, data_prefix)
    recipe.data = run.Config(getattr(llm, data_class), tokenizer=tokenizer, **data_args)
    recipe.model.tokenizer = tokenizer
    for path in apply_fields(recipe, recipe_fields(cfg, run_dir)):
        print(f"note: NeMo {versions()[0]} has no {path}, which only saves memory: not set", flush=True)
    recipe.trainer.callbacks.append(run.Config(RunMetrics, config_yaml=dump_config(cfg), run_dir=str(run_dir)))
    return recipe


_SELECTED = re.compile(r"^(?P<list>\w+)\[(?P<cls>\w+)\]$")  # callbacks[MegatronCommOverlapCallback]


def apply_fields(recipe: run.Partial, fields: dict[str, Any]) -> list[str]:
    """Set each dotted path of `fields` on the recipe; return the OPTIONAL_FIELDS this NeMo lacks (not set)."""
    skipped = []
    for path, value in fields.items():
        *parents, name = path.split(".")
        node = recipe
        for part in parents:
            node = _child(node, part, path)
        try:
            setattr(node, name, value)
        except AttributeError:  # fiddle: "No parameter named ... exists for ..."
            if path in OPTIONAL_FIELDS:
                skipped.append(path)
                continue
            raise ConfigError(f"engine=nemo: NeMo {versions()[0]}'s recipe has no {path}, which this run sets; use "
                              "a NeMo 2.7 container, or report the NeMo version") from None
    return skipped


def _child(node: Any, part: str, path: str) -> Any:
    selected = _SELECTED.match(part)
    if not selected:
        return getattr(node, part)
    matches = [item for item in getattr(node, selected["list"]) or []
               if item.__fn_or_cls__.__name__ == selected["cls"]]
    if len(matches) != 1:
        raise ConfigError(f"engine=nemo: NeMo's recipe has {len(matches)} {selected['cls']} in {selected['list']} "
                          f"(expected one) for {path}")
    return matches[0]


def to_yaml(recipe: run.Partial) -> str:
    """The recipe as nemo-run's YAML: what ran, for people to read."""
    from nemo_run.core.serialization.yaml import YamlSerializer

    return YamlSerializer().serialize(recipe)
