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

from recipes.config import Config, ConfigError


def register_schema() -> None:
    ConfigStore.instance().store(name="config_schema", node=Config)


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
    parsed = OverridesParser.create().parse_overrides(overrides)
    for override in parsed:
        key = override.key_or_group
        if key.split(".")[0] == "hydra":
            continue
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
