#!/usr/bin/env bash
# Install what the browser test (tests/site/test_browser.py) needs: the distribution's Chromium
# and the Playwright Python package, which drives that Chromium (no browser download of its own).
# Run it with the Python environment that runs the tests active.
set -euo pipefail
if [ ! -x /usr/bin/chromium ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
python -m pip install --quiet "playwright>=1.40"
dpkg-query -W chromium
python -c "import playwright.sync_api"
