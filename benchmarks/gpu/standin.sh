#!/usr/bin/env bash
# A stand-in of the lent GPU machine's Python, so that dry runs fail here on what would fail there:
# Python 3.12 with only the machine's packages (benchmarks/gpu/standin.txt, installed --no-deps, each
# one on benchmarks/gpu/machine.txt), torch 2.11 + torchvision 0.26 as there. The carried wheels are
# not in it: a dry run installs them beside it, as the machine does (benchmarks/gpu_headline.sh).
#
#   bash benchmarks/gpu/standin.sh [DIR]    # builds DIR (default .standin) once; prints its python
#
# About 5 GB (torch's CUDA libraries, as on the machine) and 2-3 minutes from the package registry.
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=${1:-.standin}
say() { echo "gpu/standin: $*" >&2; }

find_python312() {
  if command -v python3.12 >/dev/null && python3.12 -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    command -v python3.12
    return
  fi
  if command -v pyenv >/dev/null; then
    local version
    version=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -V | tail -1)
    if [ -n "$version" ]; then
      echo "$(pyenv prefix "$version")/bin/python3.12"
      return
    fi
  fi
  say "no Python 3.12 here (the GPU machine's): install one (pyenv install 3.12, or the distribution's python3.12 with venv)"
  exit 1
}

digest=$(cat benchmarks/gpu/standin.txt | sha256sum | cut -d' ' -f1)
if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.standin" 2>/dev/null)" = "$digest" ]; then
  say "reusing $venv (built from this benchmarks/gpu/standin.txt)"
else
  python=$(find_python312)
  say "building $venv with $python"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  # --no-deps: a dependency the list forgot fails `pip check` below instead of arriving unseen.
  "$venv/bin/python" -m pip install --quiet --no-deps --requirement benchmarks/gpu/standin.txt
  if ! "$venv/bin/python" -m pip check >&2; then
    say "a package of benchmarks/gpu/standin.txt needs one the list lacks (above): add it, if the machine has it"
    exit 1
  fi
  echo "$digest" >"$venv/.standin"
fi
PYTHONPATH=. "$venv/bin/python" -m benchmarks.gpu.machine check --installed
echo "$PWD/$venv/bin/python"
