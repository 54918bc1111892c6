#!/usr/bin/env bash
# The native scan on each Python the engine supports: for each interpreter, a venv of its own with
# the engine's pinned dependencies (torch included), then the kernel file built by the Dockerfile's
# kernel step in the image's Python made from that venv (conftest's sm80: sm_80 only, needs nvcc, no
# GPU) and the scan's CPU tests run against it (tests/test_boundary_scan.py, tests/test_snapshot_kernel.py):
#
#   bash bench/scan_pythons.sh OUT [PYTHON ...]     (default: pyenv's 3.11.7 3.12.1 3.13.0)
#
# A PYTHON is a version under $PYENV_ROOT/versions or a path to an interpreter. The venvs stay in
# .pyvenvs/<version>/ (git-ignored; about 6 GB each: the engine's torch carries its CUDA libraries)
# and are reused. OUT gets one log per interpreter and env.txt. Too slow for CI (a venv and a kernel
# build per interpreter): run it before a release and when the engine's images move to a new Python.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(realpath -m "${1:?usage: bash bench/scan_pythons.sh OUT [PYTHON ...]}")
shift
[ $# -ge 1 ] || set -- 3.11.7 3.12.1 3.13.0
PYENV_ROOT=${PYENV_ROOT:-/root/.pyenv}
mkdir -p "$OUT"
commit="$(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet HEAD -- adapter tests || echo ' (with local changes)')"
status=0
for want in "$@"; do
  python=$want
  [ -x "$python" ] || python="$PYENV_ROOT/versions/$want/bin/python"
  version=$("$python" -c 'import platform; print(platform.python_version())')
  venv="$ROOT/.pyvenvs/$version"
  log="$OUT/scan-python$version.log"
  echo "scan_pythons: Python $version in $venv" >&2
  if [ ! -f "$venv/ready" ]; then
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet "pip==26.3"
    "$venv/bin/pip" install --quiet -r "$ROOT/requirements/engine-0.5.23.txt"
    "$venv/bin/pip" install --quiet --no-deps "sglang==0.5.23"
    "$venv/bin/pip" install --quiet "pytest==9.2.0" "pytest-timeout==2.4.0"
    touch "$venv/ready"
  fi
  {
    "$venv/bin/python" -c 'import sys, torch, sglang, wrapt; print("python", sys.version.split()[0], "torch", torch.__version__, "sglang", sglang.__version__, "wrapt", wrapt.__version__)'
    (cd "$ROOT" && PYTHONPATH="$ROOT" "$venv/bin/python" -m pytest -p no:cacheprovider -p no:xdist -ra \
       tests/test_boundary_scan.py tests/test_snapshot_kernel.py) || status=1
  } > "$log" 2>&1 || status=1
  echo "scan_pythons: Python $version: $(grep -E '^=+ .*(passed|failed|error).* in ' "$log" | tail -1 | tr -d '=')" >&2
done
{
  echo "machine: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GB, $(uname -sr)"
  echo "nvcc: $("${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" --version | tail -1)"
  echo "commit: $commit"
} > "$OUT/env.txt"
exit $status
