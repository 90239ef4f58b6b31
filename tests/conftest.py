"""Shared fixtures: tiny deterministic checkpoints made once per test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    from engine.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {arch: str(make_tiny_model(root / arch, arch=arch, size="tiny", seed=0)) for arch in ("llama", "qwen2")}


@pytest.fixture(scope="session")
def llama_dir(model_dirs) -> str:
    return model_dirs["llama"]


@pytest.fixture(scope="module")
def ray_instance():
    """One local Ray per test module that asks for it: the module's clusters share it."""
    import ray

    ray.init(num_cpus=8, include_dashboard=False, object_store_memory=128 << 20, log_to_driver=False)
    yield
    ray.shutdown()
