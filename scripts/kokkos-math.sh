#!/usr/bin/env bash
# Kokkos 3.4 names its math functions Kokkos::Experimental::exp, ...; Kokkos 4 names them
# Kokkos::exp, ... (the Experimental names are gone). kmamba calls them as kmamba::math::exp, ...
# (core/include/kmamba/core/Math.hpp picks the right namespace from KOKKOS_VERSION). This script is
# the one mechanical rewrite between the two spellings, so that it can be redone after a rebase:
#
#   scripts/kokkos-math.sh           rewrite every tracked C++ source: Kokkos::Experimental::<f> and
#                                    Kokkos::<f> -> kmamba::math::<f> for each <f> that Math.hpp
#                                    declares, and #include <kmamba/core/Math.hpp> added after the
#                                    file's last kmamba include where it is missing, then
#                                    scripts/format.sh (idempotent)
#   scripts/kokkos-math.sh --check   change nothing; list every call that builds on one Kokkos line
#                                    only (a name above, or a math function of Kokkos::Experimental
#                                    that Math.hpp does not declare yet) and every file that calls
#                                    kmamba::math without including Math.hpp; exit 1 if any (CI)
#
# The names come from Math.hpp's using-declarations: to use another function, add it there first.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

shim=core/include/kmamba/core/Math.hpp
include_line='#include <kmamba/core/Math.hpp>'
mode=rewrite
case "${1:-}" in
  "") ;;
  --check) mode=check ;;
  -h|--help) sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "kokkos-math.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
esac

names="$(sed -n 's/^using KMAMBA_KOKKOS_MATH_NAMESPACE::\([a-z0-9_]*\);$/\1/p' "$shim" | paste -sd'|')"
[ -n "$names" ] || { echo "kokkos-math.sh: no using-declarations found in $shim" >&2; exit 2; }
# The math functions Kokkos moved out of Experimental (Kokkos 3.7, removed there in 4.0).
moved='abs|fabs|fmod|remainder|fmin|fmax|fdim|fma|pow|sqrt|cbrt|hypot|exp|exp2|expm1|log|log10|log2|log1p'
moved+='|sin|cos|tan|asin|acos|atan|atan2|sinh|cosh|tanh|asinh|acosh|atanh|erf|erfc|tgamma|lgamma'
moved+='|ceil|floor|trunc|round|nearbyint|logb|isfinite|isinf|isnan|signbit|copysign|nextafter'

if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files -- '*.hpp' '*.cpp' '*.h' '*.cu' '*.inl' | grep -vxF "$shim")
else  # an unpacked source tree without its git history
  mapfile -t files < <(find apps backends core models parallel perf tests -type f \
                         \( -name '*.hpp' -o -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.inl' \) \
                         | sort | grep -vxF "$shim")
fi

if [ "$mode" = check ]; then
  status=0
  if grep -nE "Kokkos::Experimental::($moved)\b|Kokkos::($names)\b" "${files[@]}"; then
    echo "kokkos-math.sh: the calls above compile against one Kokkos line only: call kmamba::math::<f>" >&2
    echo "  (scripts/kokkos-math.sh rewrites them; a function Math.hpp lacks is added there first)" >&2
    status=1
  fi
  for f in $(grep -lF 'kmamba::math::' "${files[@]}" || true); do
    if ! grep -qxF "$include_line" "$f"; then
      echo "$f: calls kmamba::math without $include_line" >&2
      status=1
    fi
  done
  [ "$status" = 0 ] && echo "kokkos-math.sh: every math call goes through kmamba/core/Math.hpp"
  exit "$status"
fi

changed=0
for f in $(grep -lE "Kokkos::(Experimental::)?($names)\b|kmamba::math::" "${files[@]}" || true); do
  before="$(md5sum < "$f")"
  sed -i -E "s/Kokkos::(Experimental::)?($names)\b/kmamba::math::\2/g" "$f"
  if ! grep -qxF "$include_line" "$f"; then
    # After the last '#include <kmamba/...>' that precedes the file's first other '<...>' include;
    # before that first other include (and a blank line) where the file has no kmamba include.
    awk -v inc="$include_line" '
      { line[NR] = $0 }
      /^#include <kmamba\// && !other_seen { last_kmamba = NR }
      /^#include <[^k]/ && !other_seen { other_seen = NR }
      END {
        for (i = 1; i <= NR; i++) {
          if (!last_kmamba && i == other_seen) { print inc; print "" }
          print line[i]
          if (i == last_kmamba) print inc
        }
      }' "$f" > "$f.kokkos-math" && mv "$f.kokkos-math" "$f"
  fi
  if [ "$(md5sum < "$f")" != "$before" ]; then
    echo "kokkos-math.sh: rewrote $f"
    changed=$((changed + 1))
  fi
done
echo "kokkos-math.sh: $changed file(s) rewritten"
# The shorter names can let a wrapped line fit again: lay the tree out as .clang-format says.
[ "$changed" = 0 ] || scripts/format.sh
