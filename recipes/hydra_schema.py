"""Hydra's side of the schema: register `recipes.config.Config` and check command-line keys before composing.

Hydra itself rejects unknown group options (listing the available ones) and wrong types; for a mistyped key it
only says the key is not in the struct, so `check_override_keys` names the valid keys and the closest match.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from recipes.config import CONF_DIR, Config, ConfigError
from recipes.layouts import published_layout


def register_schema() -> None:
    """The schema, and the resolver through which layout=published reads conf/layouts.yaml."""
    ConfigStore.instance().store(name="config_schema", node=Config)
    if not OmegaConf.has_resolver("published_layout"):
        OmegaConf.register_new_resolver("published_layout", published_layout)


def to_config(composed: DictConfig) -> Config:
    """The composed config as the schema's dataclasses, interpolations resolved. A ConfigError raised by a resolver
    (layout=published without a row) comes back as that ConfigError: OmegaConf wraps it and keeps only its text."""
    try:
        return OmegaConf.to_object(composed)
    except InterpolationResolutionError as error:
        prefix = f"{ConfigError.__name__} raised while resolving interpolation: "
        first_line = str(error).splitlines()[0]
        if first_line.startswith(prefix):
            raise ConfigError(first_line[len(prefix):]) from None
        raise


def _unwrap_dataclass(hint: typing.Any) -> type | None:
    if dataclasses.is_dataclass(hint):
        return hint
    for arg in typing.get_args(hint):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def check_override_keys(overrides: list[str]) -> None:
    """Raise ConfigError for an override whose key is not in the schema, '+key' and '++key' included: Hydra would
    accept an added key and the schema would then drop it silently."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException as error:
        raise ConfigError(f"cannot read the command line: {str(error).splitlines()[0]}; quote a value that holds "
                          "quotes, spaces or any of =,[]{}() as Hydra's override grammar says (key='a b', "
                          "key=\"it's\")") from None
    for override in parsed:
        key = override.key_or_group
        check_not_a_name(key)
        if key.split(".")[0] == "hydra" or (CONF_DIR / key).is_dir():
            continue  # Hydra's own settings, or a group choice (layout=published: a group with no field of its own)
        node: type | None = Config
        walked: list[str] = []
        for part in key.split("."):
            fields = typing.get_type_hints(node)
            if part not in fields:
                where = ".".join(walked) or "the top level"
                close = difflib.get_close_matches(part, fields, n=1)
                hint = f" Did you mean '{'.'.join(walked + close)}'?" if close else ""
                raise ConfigError(
                    f"unknown key '{key}'.{hint} Valid keys under {where}: {', '.join(sorted(fields))}"
                )
            walked.append(part)
            node = _unwrap_dataclass(fields[part])
            if node is None:
                break


# Groups whose `name` is the option chosen (conf/GROUP/NAME.yaml): what the plan, summary.json and the report call
# the run. executor.name is not a label but the executor itself, checked as an enum.
NAMED_GROUPS = ("model", "precision", "gpu", "data")


def check_not_a_name(key: str) -> None:
    """A group's name is not set on its own: model.name=llama3_70b over model=tiny_llama would report a tiny model
    as Llama 3 70B. The name follows the option; a variant of an option is a file of its own."""
    group, _, field = key.lstrip("+~").partition(".")
    if group in NAMED_GROUPS and field == "name":
        raise ConfigError(f"{key.lstrip('+~')} is the name of the {group} option chosen, and what the plan, "
                          f"summary.json and the report call the run: choose another option ({group}=...; --help "
                          f"lists them), or add conf/{group}/NAME.yaml for a variant of your own")
