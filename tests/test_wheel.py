"""The wheel ships what the kernels' build needs: built with `pip wheel`, installed into a fresh
venv (its dependencies borrowed from this one, nothing downloaded), an engine started from the
installed package builds the kernels from the installed sources and gives transformers' tokens."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

from engine.kernels import kernel_build
from tests.reference import hf_greedy

ROOT = Path(__file__).resolve().parent.parent
# the top-level packages pyproject.toml's find includes ("engine*" -> engine)
PACKAGES = [name.rstrip("*") for name in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
            ["packages"]["find"]["include"]]
PROMPT = [5, 17, 300, 42, 8, 99, 1000]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """`pip wheel` of a copy of the source tree (a build in place would leave build/ in the checkout)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in PACKAGES:
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(out), str(src)], check=True, capture_output=True, text=True)
    (built,) = out.glob("pdserve-*.whl")
    return built


def test_the_wheel_ships_every_file_of_the_kernels_build(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    needed = {f"engine/kernels/csrc/{path.name}" for path in (*kernel_build.SOURCES, *kernel_build.HEADERS)}
    assert {name for name in needed if name.endswith(".h")}, "the kernels' headers are part of the build"
    assert sorted(needed - names) == []


@pytest.mark.slow
def test_an_engine_from_the_installed_wheel_runs_its_kernels(wheel, llama_dir, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
                    str(wheel)], check=True, capture_output=True, text=True)
    # torch, transformers and the rest from this venv's site-packages, after the venv's own (a plain
    # path line: this venv's editable install of pdserve, itself a .pth, is not processed)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    script = textwrap.dedent(f"""
        import json, engine
        from engine.config import EngineConfig
        from engine.llm_engine import LLMEngine
        from protocol.sampling import SamplingParams
        e = LLMEngine(EngineConfig(model_path={llama_dir!r}, dtype="float32", num_blocks=64, cpu_kernels="on"))
        tokens = e.generate([{PROMPT!r}], SamplingParams(max_tokens=8, ignore_eos=True))[0]
        print(json.dumps({{"engine": engine.__file__, "describe": e.runner.describe(), "tokens": tokens}}))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PDSERVE_KERNEL_ARCH")}
    env["PDSERVE_KERNEL_CACHE"] = str(tmp_path / "kernels")  # built here, from the installed sources
    done = subprocess.run([str(python), "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(result["engine"]).is_relative_to(venv), result["engine"]
    described = result["describe"]
    assert not described.startswith("CPU kernels none") and "attention by the CPU kernels" in described, described
    assert [p.name for p in (tmp_path / "kernels").glob("pdserve_kernels-native-*.so")]
    assert result["tokens"] == hf_greedy(llama_dir, PROMPT, 8, ignore_eos=True)
