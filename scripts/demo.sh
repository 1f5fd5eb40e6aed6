#!/usr/bin/env bash
# The main job: a local cluster (1 scheduler, 2 servers, 4 workers) trains a CNN on
# Fashion-MNIST asynchronously and prints the test accuracy. Extra arguments go to the example.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p runs
exec .venv/bin/hogshard launch --servers 2 --workers 4 --policy async -- \
  .venv/bin/python examples/fashion_mnist.py --epochs 2 --report runs/fashion_mnist.json "$@"
