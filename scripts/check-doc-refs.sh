#!/usr/bin/env bash
# Checks the section citations of the tree against docs/: every `docs/<file>.md §X` must name a file
# of docs/ with a heading that starts with the number X (docs/algorithms.md §2.6 needs a heading like
# `## 2.6 Chunked SSD backward`). A line may cite several sections of one file after it, e.g.
# docs/algorithms.md §2.1–§2.3, §2.7.
#
# In source files (*.cpp *.hpp *.h *.inc *.txt *.cmake *.sh *.py) every § must follow such a
# citation on the same line (or an `RFC <n>`, an outside standard), so that a citation of a document
# that is not in the repository (a bare algorithms.md or "spec" before the section sign) fails too. Inside docs/<file>.md a
# § with no file before it on its line cites <file> itself. In other Markdown files only the
# `docs/<file>.md §X` citations are checked (perf/RESULTS.md's history may cite older documents).
# Not searched: build trees, .git, and directories named data or corpus (test data).
#
#   scripts/check-doc-refs.sh [SOURCE_DIR]      # default: the directory above this script
#
# Prints each bad citation as path:line: message and exits 1, or prints a summary and exits 0.
set -euo pipefail
export LC_ALL=C
root="${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
cd "$root"
[ -d docs ] || { echo "check-doc-refs: $root has no docs/ directory" >&2; exit 1; }

sect=$'\xc2\xa7'  # the UTF-8 bytes of §
tab=$'\t'
# The section numbers of the headings of every docs file, as "file<TAB>number" lines: the number
# that starts a heading's text ("## 2.10 Decode step" gives 2.10), without a trailing dot.
headings="$(for f in docs/*.md; do
  sed -n 's/^#\{1,6\} \([0-9][0-9.]*\)\( .*\)\{0,1\}$/\1/p' "$f" | sed -e 's/\.$//' -e "s|^|$f$tab|"
done)"

has_heading() {  # file number (a string match: a pipe into grep -q could fail on SIGPIPE under pipefail)
  [[ $'\n'"$headings"$'\n' == *$'\n'"$1$tab$2"$'\n'* ]]
}

errors=0 citations=0 files=0
report() { echo "$1: $2" >&2; errors=$((errors + 1)); }

# Files that hold a §, outside build trees, Git's metadata and test data.
mapfile -t candidates < <(grep -rlF "$sect" . \
  --exclude-dir=.git --exclude-dir='build*' --exclude-dir=.deps --exclude-dir=.gl \
  --exclude-dir=gpu-out --exclude-dir=multi-gpu-out --exclude-dir=data --exclude-dir=corpus 2>/dev/null | sort || true)

for path in "${candidates[@]}"; do
  path="${path#./}"
  case "$path" in
    *.md) strict=0 ;;
    *.cpp|*.hpp|*.h|*.inc|*.txt|*.cmake|*.sh|*.py) strict=1 ;;
    *) continue ;;
  esac
  files=$((files + 1))
  # Within a docs file a § without a file before it on its line cites that file itself.
  own=""
  case "$path" in docs/*.md) own="$path" ;; esac
  # Tokens in order, one per line as "line:token": citations of docs files, sections, RFCs.
  current="" current_line=""
  while IFS= read -r item; do
    line="${item%%:*}" token="${item#*:}"
    if [ "$line" != "$current_line" ]; then current="$own" current_line="$line"; fi
    case "$token" in
      docs/*.md)
        current="$token"
        [ -f "$current" ] || { report "$path:$line" "$current does not exist"; current="missing"; } ;;
      RFC*) current="rfc" ;;
      "$sect"*)
        number="${token#"$sect"}"
        case "$current" in
          "")
            if [ "$strict" = 1 ]; then
              report "$path:$line" "${sect}$number is not preceded by a docs/<file>.md citation on its line"
            fi ;;
          rfc|missing) ;;
          *)
            citations=$((citations + 1))
            has_heading "$current" "$number" \
              || report "$path:$line" "$current ${sect}$number: $current has no heading '$number'" ;;
        esac ;;
    esac
  done < <(grep -noE "docs/[A-Za-z0-9_-]+\.md|RFC [0-9]+|${sect}[0-9]+(\.[0-9]+)*" "$path" || true)
done

if [ "$errors" -gt 0 ]; then
  echo "check-doc-refs: $errors bad citation(s); the sections are the headings of docs/*.md" >&2
  exit 1
fi
echo "check-doc-refs: $citations citation(s) in $files file(s) resolve to headings of docs/"
