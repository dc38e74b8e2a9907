#!/usr/bin/env bash
# Formats the C++ sources with the root .clang-format (`scripts/format.sh`), or checks that they
# already are (`scripts/format.sh --check`, exit 1 naming the files that differ). Layout differs
# between clang-format major versions, so the check runs only with the version the tree is
# formatted with (14, Debian 12's) and says so when it skips.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

usage() { echo "usage: scripts/format.sh [--check]   (format the tree, or check that it is formatted)"; }
check=0
case "${1:-}" in
  "") ;;
  --check) check=1 ;;
  -h|--help) usage; exit 0 ;;
  *) echo "format.sh: error: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
esac

tool="$(command -v clang-format-14 || command -v clang-format || true)"
if [ -z "$tool" ]; then
  echo "format.sh: clang-format is not installed (apt-get install clang-format-14)" >&2
  [ "$check" = 1 ] && { echo "format.sh: check skipped"; exit 0; }
  exit 3
fi
major="$("$tool" --version | sed -n 's/.*version \([0-9]*\).*/\1/p')"
if [ "$major" != 14 ]; then
  echo "format.sh: $tool is version $major; the tree is formatted with version 14" >&2
  [ "$check" = 1 ] && { echo "format.sh: check skipped"; exit 0; }
fi

mapfile -t files < <(git ls-files '*.hpp' '*.cpp' '*.h' '*.cu')
if [ "$check" = 0 ]; then
  "$tool" -i "${files[@]}"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  "$tool" "$f" | cmp -s - "$f" || bad+=("$f")
done
if [ "${#bad[@]}" -gt 0 ]; then
  echo "format.sh: ${#bad[@]} file(s) differ from .clang-format's layout (run scripts/format.sh):" >&2
  printf '  %s\n' "${bad[@]}" >&2
  exit 1
fi
echo "format.sh: ${#files[@]} files formatted"
