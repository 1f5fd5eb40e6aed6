#!/usr/bin/env bash
# Install (into .venv) and run the whole test suite: unit tests, then integration tests that
# start real processes over real sockets. Lint (ruff) and type checks (mypy) first. Extra
# arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
bash scripts/typecheck.sh
exec .venv/bin/python -m pytest -q "$@"
