#!/usr/bin/env bash
# Create .venv and install pdserve into it (editable) with the given extras, e.g. "test".
# torch is pinned to the CPU wheel on machines without a GPU so no multi-GB CUDA build is pulled.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
[ -x .venv/bin/python ] || python3 -m venv .venv
torch_spec="torch==2.13.0"
if command -v nvidia-smi >/dev/null 2>&1; then torch_spec="torch>=2.4,<=2.13.0"; fi
.venv/bin/python -m pip install -q "$torch_spec" -e ".${extras:+[$extras]}"
