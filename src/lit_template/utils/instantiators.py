"""Instantiate the named dicts of callbacks and loggers (``callbacks.early_stopping=null`` turns one off)."""

from __future__ import annotations

from typing import Any

import hydra
from omegaconf import DictConfig

from lit_template.errors import ConfigError


def _instantiate_group(cfg: DictConfig | None, group: str) -> list[Any]:
    if not cfg:
        return []
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"`{group}` must be a mapping of named configs, got {type(cfg).__name__}")
    objects = []
    for name, conf in cfg.items():
        if conf is None:
            continue
        if not isinstance(conf, DictConfig) or "_target_" not in conf:
            raise ConfigError(f"`{group}.{name}` needs a `_target_` (the class to build), got: {conf}")
        objects.append(hydra.utils.instantiate(conf))
    return objects


def instantiate_callbacks(cfg: DictConfig | None) -> list[Any]:
    return _instantiate_group(cfg, "callbacks")


def instantiate_loggers(cfg: DictConfig | None) -> list[Any]:
    return _instantiate_group(cfg, "logger")
