#!/usr/bin/env bash
# Set up .venv on a fresh machine: the pinned engine (sglang 0.5.23, CPU-importable),
# its pinned dependencies, the test tools and the pack itself (editable, so that its
# plugin entry point is registered for the engine's plugin loader).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade "pip==26.3"
"$VENV/bin/pip" install --quiet -r requirements/engine-0.5.23.txt
"$VENV/bin/pip" install --quiet --no-deps "sglang==0.5.23"
"$VENV/bin/pip" install --quiet --no-deps -e .
"$VENV/bin/pip" install --quiet "pytest==9.2.0" "pytest-timeout==2.4.0"
echo "setup: $("$VENV/bin/python" -c 'import importlib.metadata as m; print("sglang", m.version("sglang"), "torch", m.version("torch"), "pack", m.version("sglang-dsv41-adapters"))')"
