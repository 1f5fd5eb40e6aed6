#!/usr/bin/env bash
# Create .venv (once) and install hogshard with its worker, example and test extras.
# torch comes from the CPU build pinned below (the CPU wheel index where it is reachable, else
# a local CPU wheel pip finds), installed first so nothing pulls a CUDA build; only a CUDA build
# installed after all gets a warning.
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
    # The CPU wheel index where it answers (elsewhere a bare torch==X is the multi-GB CUDA
    # build); where it does not (an offline machine with a local CPU wheel), the plain name.
    cpu_index="${HOGSHARD_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
    torch_args=()
    if .venv/bin/python -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=5)" "$cpu_index" 2>/dev/null; then
      torch_args=(--extra-index-url "$cpu_index")
      echo "installing torch==${TORCH_VERSION} (CPU build, from $cpu_index)..." >&2
    else
      echo "installing torch==${TORCH_VERSION}..." >&2
    fi
    .venv/bin/python -m pip install --quiet "${torch_args[@]}" "torch==${TORCH_VERSION}" numpy 2>&1 | grep -v '^WARNING: Location' >&2 || true
    .venv/bin/python -c "import torch" || {
      echo "could not install torch==${TORCH_VERSION}; install a CPU build of torch into .venv by hand" >&2
      exit 1
    }
    # Only a real problem is worth a word: pip found no CPU build and took the CUDA one.
    if ! .venv/bin/python -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then
      echo "warning: pip installed a CUDA build of torch (the CPU wheel index $cpu_index did not answer and no local CPU wheel was found); uninstall it and install a CPU wheel (HOGSHARD_TORCH_INDEX=URL names another index)" >&2
    fi
  fi
  echo "installing hogshard and its dependencies..." >&2
  .venv/bin/python -m pip install --quiet -e ".[worker,examples,test]" 2>&1 | grep -v '^WARNING: Location' >&2 || true
  .venv/bin/python -c "import hogshard.ps, hogshard.worker.optimizer, pytest, sklearn" || exit 1
  echo "$want" > "$stamp"
fi
