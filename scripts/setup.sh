#!/usr/bin/env bash
# Create .venv (once) and install hogshard with its worker, example and test extras.
# torch comes from the CPU build pinned below, installed first so nothing pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION="${HOGSHARD_TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "hogshard needs Python >= 3.11 (found $("$PYTHON" --version 2>&1)); set PYTHON=..." >&2
  exit 1
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
stamp=".venv/.hogshard-installed"
want="$(cat setup.cfg pyproject.toml | sha256sum | cut -c1-16)-torch${TORCH_VERSION}"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip 2>/dev/null || true
  if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
    echo "installing torch==${TORCH_VERSION} (CPU build)..." >&2
    .venv/bin/python -m pip install --quiet "torch==${TORCH_VERSION}" numpy 2>&1 | grep -v '^WARNING: Location' >&2 || true
    .venv/bin/python -c "import torch" || {
      echo "could not install torch==${TORCH_VERSION}; install a CPU build of torch into .venv by hand" >&2
      exit 1
    }
  fi
  echo "installing hogshard and its dependencies..." >&2
  .venv/bin/python -m pip install --quiet -e ".[worker,examples,test]" 2>&1 | grep -v '^WARNING: Location' >&2 || true
  .venv/bin/python -c "import hogshard.ps, hogshard.worker.optimizer, pytest, sklearn" || exit 1
  echo "$want" > "$stamp"
fi
