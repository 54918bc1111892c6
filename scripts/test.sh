#!/usr/bin/env bash
# Set everything up (scripts/setup.sh) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -ra "$@"
