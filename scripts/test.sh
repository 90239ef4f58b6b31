#!/usr/bin/env bash
# Install pdserve with its test extras, lint, and run the whole test suite.
# `--fast` leaves out the tests marked slow (-m "not slow"); `--all` adds the tests marked
# exhaustive, which the default leaves out (--exhaustive); other arguments go to pytest.
# The suite runs on two xdist workers; the tests that use Ray run in order in three groups
# (tests/conftest.py); `-n 0` runs it in this one process.
set -euo pipefail
cd "$(dirname "$0")/.."
args=()
for arg in "$@"; do
  case "$arg" in
    --fast) args+=(-m "not slow") ;;
    --all) args+=(--exhaustive) ;;
    *) args+=("$arg") ;;
  esac
done
bash scripts/setup.sh test
export RAY_USAGE_STATS_ENABLED=0
.venv/bin/ruff check .
workers=(-n 2 --dist loadgroup)
[ "$(nproc)" -ge 2 ] || workers=(-n 0)
.venv/bin/python -m pytest -q --durations=25 "${workers[@]}" ${args[@]+"${args[@]}"}
