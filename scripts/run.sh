#!/usr/bin/env bash
# Install pdserve and serve the default cluster (embedded tiny model, 1 prefill + 1 decode).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/pdserve serve --config cluster.yaml "$@"
