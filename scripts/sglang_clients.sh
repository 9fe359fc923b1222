#!/usr/bin/env bash
# Install SGLang's own clients, for the tests that run them against srt: the frontend language
# (sglang 0.5.23, without its server's dependencies) and the `smg` gateway (sglang-router 0.3.2),
# plus the few packages `import sglang` needs beyond srt's own. They go into a folder of their
# own, put on PYTHONPATH only by the processes that run them, so srt's environment never
# imports sglang. Prints that folder. Safe to run again: it installs only what is missing.
#   SRT_SGLANG_CLIENTS=path   where they go (default: sglang-clients in srt's cache folder,
#                             $SRT_CACHE_DIR or ~/.cache/srt, outside the repository)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ]; then source "${SRT_VENV:-.venv}/bin/activate"; fi

PACKAGES=(sglang==0.5.23 sglang-router==0.3.2
          orjson pybase64 msgspec ipython traitlets setproctitle)
dir="${SRT_SGLANG_CLIENTS:-${SRT_CACHE_DIR:-$HOME/.cache/srt}/sglang-clients}"
stamp="$dir/.srt-clients"
want="python$(python -c 'import sys; print("%d.%d" % sys.version_info[:2])') ${PACKAGES[*]}"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  rm -rf "$dir"
  python -m pip install -q --disable-pip-version-check --no-deps --target "$dir" \
    "${PACKAGES[@]}" >&2
  echo "$want" > "$stamp"
fi
echo "$dir"
