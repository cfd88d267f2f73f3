#!/usr/bin/env bash
# Headless Chromium for the dashboard test (tests/test_dashboard.py): Debian's package,
# installed once; later runs find it on PATH and do nothing.
#
#   scripts/chromium.sh            install if missing, then print the binary's path
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PLEXRL_LOG_TAG=chromium
# shellcheck source=scripts/_lib.sh
source "$ROOT/scripts/_lib.sh"

ensure_cmd chromium chromium
command -v chromium
