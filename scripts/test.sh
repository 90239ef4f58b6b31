#!/usr/bin/env bash
# Install pdserve with its test extras, lint, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
export RAY_USAGE_STATS_ENABLED=0
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
