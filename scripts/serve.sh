#!/usr/bin/env bash
# Set up (once) and start the server; with no arguments it serves the default model on the CPU
# or GPU at http://127.0.0.1:30000. Extra arguments go to `python -m srt.server`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ -z "${VIRTUAL_ENV:-}" ]; then source "${SRT_VENV:-.venv}/bin/activate"; fi
exec python -m srt.server "$@"
