#!/usr/bin/env bash
# Sets up, builds and runs kmamba's main job on this machine: kmamba-train's default run (a small
# Mamba-2 learns multi-query associative recall; results in runs/recall/).
#
#   scripts/quickstart.sh [build.sh options]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
build_dir="$("$here/build.sh" "$@" | tail -n 1)"
OMP_PROC_BIND="${OMP_PROC_BIND:-spread}" OMP_PLACES="${OMP_PLACES:-threads}" "$build_dir/apps/kmamba-train"
