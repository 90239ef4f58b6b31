"""Shared fixtures: tiny deterministic checkpoints and a test PKI, made once per test session."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    from checkpoints.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {arch: str(make_tiny_model(root / arch, arch=arch, size="tiny", seed=0)) for arch in ("llama", "qwen2")}


@pytest.fixture(scope="session")
def llama_dir(model_dirs) -> str:
    return model_dirs["llama"]


RAY_OPTIONS = dict(num_cpus=8, include_dashboard=False, object_store_memory=128 << 20, log_to_driver=False)


@pytest.fixture(scope="module")
def ray_instance(_ray_at_exit):
    """One local Ray for the whole session, started by the first module that asks for it: the
    modules' clusters come and go on it (a Ray start costs about 7 s here). Workers are unnamed
    actors, so a module's leftovers cannot collide with the next module's."""
    import ray

    if not ray.is_initialized():
        ray.init(**RAY_OPTIONS)
    yield


@pytest.fixture(scope="session")
def _ray_at_exit():
    yield
    import ray

    ray.shutdown()


@pytest.fixture(scope="module")
def no_shared_ray():
    """For a module that starts Ray nodes of its own: the shared instance stops first."""
    import ray

    ray.shutdown()


def _openssl(cwd: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> Path:
    """ca.pem; server.pem/.key for localhost and 127.0.0.1; client.pem/.key (clientAuth)."""
    d = tmp_path_factory.mktemp("pki")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(d, "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=pdserve test CA",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign")
    for name, ext in (("server", "extendedKeyUsage=serverAuth\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n"),
                      ("client", "extendedKeyUsage=clientAuth\n")):
        _openssl(d, "req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=pdserve test {name}")
        (d / f"{name}.ext").write_text(ext)
        _openssl(d, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")
    return d
