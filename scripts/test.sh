#!/usr/bin/env bash
# Sets up, builds and runs the whole CPU test suite (everything but the `cuda` label).
#
#   scripts/test.sh [build.sh options]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
build_dir="$("$here/build.sh" --werror "$@" | tail -n 1)"
cd "$build_dir"
ctest --output-on-failure -LE cuda -j "$(nproc 2>/dev/null || echo 2)"
