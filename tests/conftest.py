"""Fixtures shared by test modules."""

from __future__ import annotations

import pytest

from recipes.config import CONF_DIR, Config


@pytest.fixture(scope="module")
def hydra_compose():
    """Compose conf/ in this process, as launch/run.py does (many combinations: too many subprocesses)."""
    from hydra import compose, initialize_config_dir

    from recipes.hydra_schema import register_schema, to_config
    from recipes.plan import resolve

    register_schema()

    def composed(*overrides: str) -> Config:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return resolve(to_config(compose("config", overrides=list(overrides))))

    return composed
