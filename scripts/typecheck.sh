#!/usr/bin/env bash
# Type-check proto/, ps/, scheduler/ and worker/ with mypy, as the installed `hogshard.*`
# packages. setup.cfg maps the top-level folders onto the namespace, which mypy cannot follow
# through an editable install, so the check runs over a tree of links that has the installed shape.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
tree="$root/.mypy-tree"
rm -rf "$tree"
mkdir -p "$tree/hogshard"
for entry in "$root"/hogshard/*; do ln -s "$entry" "$tree/hogshard/"; done
for package in proto ps scheduler worker; do ln -s "$root/$package" "$tree/hogshard/$package"; done
cd "$tree"
exec "$root/.venv/bin/python" -m mypy --config-file "$root/pyproject.toml" --cache-dir "$root/.mypy_cache" \
  -p hogshard.proto -p hogshard.ps -p hogshard.scheduler -p hogshard.worker "$@"
