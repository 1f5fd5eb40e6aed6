#!/usr/bin/env bash
# Install (into .venv) and run the whole test suite: unit tests, then integration tests that
# start real processes over real sockets. Lint (ruff) and type checks (mypy) first.
#
# Without arguments: every test but the system ones on HOGSHARD_TEST_WORKERS pytest processes
# at once (default 2; pytest-xdist, a file per process at a time, so a file's shared clusters
# are started once), then the system tests (one docker compose or SLURM cluster at a time).
# With arguments: one pytest with those arguments (e.g. a file, -k, -m "not slow").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
bash scripts/typecheck.sh
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
.venv/bin/python -m pytest -q -n "${HOGSHARD_TEST_WORKERS:-2}" --dist loadfile -m "not system"
exec .venv/bin/python -m pytest -q -m system
