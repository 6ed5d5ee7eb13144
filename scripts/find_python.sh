#!/bin/sh
# Print the Python interpreter `make` builds its virtual environment with.
#
#   scripts/find_python.sh           Python 3.12 (what the GPU machines run) if it is here,
#                                    else the newest Python >= 3.12, else python3
#   scripts/find_python.sh --newest  the newest Python >= 3.12, else python3
#
# Looks at pythonX.Y on PATH and at pyenv's installed versions (a pyenv shim of a
# version that is not selected fails to run, so every candidate is run once).  Says on
# stderr which one it picked and, when it falls back to python3, why.
set -u
mode=${1:-gpu}
candidates=""
for minor in 20 19 18 17 16 15 14 13 12; do
  candidates="$candidates python3.$minor"
done
root=$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")
for dir in $(ls -d "$root"/versions/3.* 2>/dev/null | sort -t. -k2,2nr -k3,3nr); do
  candidates="$candidates $dir/bin/python3"
done

works() {  # prints "major minor" when "$1" runs and has venv
  "$1" -c 'import sys, venv; print(*sys.version_info[:2])' 2>/dev/null
}

best="" best_minor=0 gpu=""
for c in $candidates; do
  v=$(works "$c") || continue
  set -- $v
  [ "$1" -eq 3 ] && [ "$2" -ge 12 ] || continue
  path=$(command -v "$c" 2>/dev/null || echo "$c")
  if [ "$2" -eq 12 ] && [ -z "$gpu" ]; then gpu=$path; fi
  if [ "$2" -gt "$best_minor" ]; then best=$path; best_minor=$2; fi
done

if [ "$mode" != "--newest" ] && [ -n "$gpu" ]; then
  echo "find_python: $gpu (Python 3.12, as on the GPU machines)" >&2
  echo "$gpu"
elif [ -n "$best" ]; then
  echo "find_python: $best (Python 3.$best_minor, the newest >= 3.12 here)" >&2
  echo "$best"
else
  echo "find_python: no Python >= 3.12 here (JAX 0.11 needs it); using python3," \
       "$(python3 -c 'import sys; print(sys.version.split()[0])' 2>/dev/null)" >&2
  echo python3
fi
