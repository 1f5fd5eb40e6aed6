#!/usr/bin/env bash
# Install a headless browser for the status page's test (tests/integration/test_status_page.py):
# Debian's chromium and chromium-driver, quietly, only where they are absent and this is root
# with apt-get. Selenium comes with the test extra (scripts/setup.sh). Never fails: without a
# browser the test skips and says why.
set -uo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
  exit 0
fi
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null; then
  echo "browser-setup: no chromium/chromedriver and not root with apt-get: the status page's browser test will skip" >&2
  exit 0
fi
log=/tmp/hogshard-browser-setup.log
echo "browser-setup: apt-get install chromium chromium-driver" >&2
if ! { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
       --no-install-recommends chromium chromium-driver; } >"$log" 2>&1; then
  echo "browser-setup: the install failed (see $log): the status page's browser test will skip" >&2
fi
exit 0
