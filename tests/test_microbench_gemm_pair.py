"""microbench/gemm_pair.py's pieces that need no kernel build: the revision's sources it compiles,
and its flags checked before any work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from microbench.gemm_pair import CSRC, _sources_at

ROOT = Path(__file__).resolve().parent.parent


def test_a_revisions_sources_are_every_kernel_file_it_tracks_byte_for_byte(tmp_path):
    _sources_at("HEAD", tmp_path)
    tracked = subprocess.run(["git", "ls-tree", "--name-only", f"HEAD:{CSRC}"], capture_output=True, text=True,
                             check=True, cwd=ROOT).stdout.split()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(tracked)
    assert any(name.endswith(".h") for name in tracked) and any(name.endswith(".c") for name in tracked)
    for name in tracked:
        blob = subprocess.run(["git", "show", f"HEAD:{CSRC}/{name}"], capture_output=True, check=True, cwd=ROOT).stdout
        assert (tmp_path / name).read_bytes() == blob


def test_misused_flags_exit_2_before_any_build():
    done = subprocess.run([sys.executable, "-m", "microbench.gemm_pair", "--rounds", "0"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2
    assert "--rounds, --threads and every --rows value must be at least 1" in done.stderr
