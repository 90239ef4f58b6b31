#!/usr/bin/env bash
# Install pdserve with its test extras, lint, and run the whole test suite.
# `--fast` leaves out the tests marked slow (-m "not slow"); other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
args=()
for arg in "$@"; do
  if [[ "$arg" == "--fast" ]]; then args+=(-m "not slow"); else args+=("$arg"); fi
done
bash scripts/setup.sh test
export RAY_USAGE_STATS_ENABLED=0
.venv/bin/ruff check .
.venv/bin/python -m pytest -q ${args[@]+"${args[@]}"}
