"""Regenerate proto/pdserve_pb2*.py(i) from proto/pdserve.proto; `--check` fails if they are stale.

Generated with `-I .` on `proto/pdserve.proto`, so the modules import each other as
`from proto import pdserve_pb2` and need no sys.path tricks.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUTPUTS = ("pdserve_pb2.py", "pdserve_pb2.pyi", "pdserve_pb2_grpc.py")
# The generators' own version stamps: a newer grpcio-tools or protoc writes its version here (and the
# module then demands at least that runtime), with the same code for the same .proto. The committed
# stamps stay as generated (the lowest runtimes they accept); only the rest must match.
STAMPS = (
    re.compile(r"^(GRPC_GENERATED_VERSION = )'[^']*'$", re.M),
    re.compile(r"^(# Protobuf Python Version: ).*$", re.M),
    re.compile(r"(ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,)\s*\d+,\s*\d+,\s*\d+,"),
)


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc  # test extra: only needed to regenerate

    args = [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(ROOT / "proto" / "pdserve.proto"),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on proto/pdserve.proto")


def unstamped(text: str) -> str:
    """`text` with the generators' version stamps (STAMPS) blanked."""
    for stamp in STAMPS:
        text = stamp.sub(r"\1<version>", text)
    return text


def stale_files() -> list[str]:
    """Names of generated files that differ from what protoc makes now, version stamps aside."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = Path(tmp) / "proto"
        return [n for n in OUTPUTS if not (ROOT / "proto" / n).exists()
                or unstamped((fresh / n).read_text()) != unstamped((ROOT / "proto" / n).read_text())]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if generated files are stale")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        if stale:
            print(f"stale generated files: {', '.join(stale)}; run proto/gen_proto.py", file=sys.stderr)
            return 1
        print("generated proto modules are up to date")
        return 0
    generate(ROOT)
    print("regenerated " + ", ".join(f"proto/{n}" for n in OUTPUTS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
