"""Reading `cluster.yaml`: parse, type-check, range-check, resolve the files it names."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from router.config.autoscale import read_measured_profile
from router.config.checks import check_host_memory, check_values, security_files
from router.config.schema import ClusterConfig
from router.config.typed_yaml import ConfigError, build


def load_config(path: str | Path) -> ClusterConfig:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    cfg = parse_config(raw, where=str(path), base_dir=path.parent)
    model_path = Path(cfg.model.path)
    if not model_path.is_absolute():
        model_path = (path.parent / model_path).resolve()
    if cfg.router.request_log is not None:
        cfg = dataclasses.replace(cfg, router=dataclasses.replace(
            cfg.router, request_log=str((path.parent / cfg.router.request_log).resolve())))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(model_path)))
    auto = cfg.router.autoscale
    if auto.measured_profile is not None:  # relative to cluster.yaml, read and checked now
        profile = str((path.parent / auto.measured_profile).resolve())
        read_measured_profile(profile, cfg.kv_cache.block_size, str(path))
        cfg = dataclasses.replace(cfg, router=dataclasses.replace(
            cfg.router, autoscale=dataclasses.replace(auto, measured_profile=profile)))
    check_host_memory(cfg, str(path))
    return cfg


def parse_config(raw: Any, where: str = "cluster.yaml", base_dir: Path | None = None) -> ClusterConfig:
    """`base_dir`: what relative router.tls / router.auth files are relative to (default: the cwd)."""
    cfg = build(ClusterConfig, raw, prefix="", where=where)
    check_values(cfg, where)
    return security_files(cfg, base_dir or Path.cwd(), where)
