#!/usr/bin/env bash
# Fill docker/wheelhouse/ with every wheel the images install, using this host's pip (its
# indexes, proxies, certificates and local wheels, e.g. a CPU torch on disk), so that
#   docker build --build-arg PIP_ARGS=--no-index ...
# needs no network at all. The wheels must suit the image's Python: run it with a Python of the
# same minor version (3.11 for python:3.11-slim and for docker/make-base-image.sh's image).
#   bash docker/make-wheelhouse.sh            # PYTHON=python3.11, TORCH_SPEC=torch==2.13.0
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
out=docker/wheelhouse
"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || {
  echo "make-wheelhouse: needs Python 3.11 for the images' Python (set PYTHON=...)" >&2; exit 1; }
# torch first and on its own, so that nothing resolves a CUDA build by accident.
"$PYTHON" -m pip wheel --quiet --wheel-dir "$out" "$TORCH_SPEC"
"$PYTHON" -m pip wheel --quiet --wheel-dir "$out" "setuptools>=64" wheel . scikit-learn matplotlib
rm -f "$out"/hogshard-*.whl  # the images build hogshard from the source they copy
echo "make-wheelhouse: $(ls "$out"/*.whl | wc -l) wheels, $(du -sh "$out" | cut -f1) in $out" >&2
