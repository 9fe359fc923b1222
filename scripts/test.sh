#!/usr/bin/env bash
# Set up (once) and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ -z "${VIRTUAL_ENV:-}" ]; then source "${SRT_VENV:-.venv}/bin/activate"; fi
exec python -m pytest -q -ra "$@"
