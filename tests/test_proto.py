"""The committed generated gRPC modules match proto/pdserve.proto."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_modules_are_fresh():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


def test_stale_check_notices_an_edit(tmp_path, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    fake_root = tmp_path / "repo"
    (fake_root / "proto").mkdir(parents=True)
    for name in ("pdserve.proto", *gen.OUTPUTS):
        (fake_root / "proto" / name).write_bytes((ROOT / "proto" / name).read_bytes())
    proto = fake_root / "proto" / "pdserve.proto"
    proto.write_text(proto.read_text().replace("message Usage {", "message Usage {\n  uint32 extra_field = 99;"))
    monkeypatch.setattr(gen, "ROOT", fake_root)
    assert "pdserve_pb2.py" in gen.stale_files()
