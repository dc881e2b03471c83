#!/usr/bin/env bash
# The dashboard's browser test drives Debian's chromium (never a browser download).
# Install it if it is missing and this user may (root with apt); otherwise say how.
set -euo pipefail
CHROMIUM=${TEST_CHROMIUM:-/usr/bin/chromium}
if [ -x "$CHROMIUM" ]; then
  exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "browser: installing Debian's chromium for the dashboard test"
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium >/dev/null ||
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium >/dev/null; }
  exit 0
fi
echo "browser: $CHROMIUM is missing; install Debian's chromium (apt-get install chromium) or set TEST_CHROMIUM" >&2
exit 1
