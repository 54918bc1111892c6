#!/usr/bin/env bash
# Set everything up (scripts/setup.sh) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# One worker per core (two on CI), each taking whole test files so that a file's shared
# fixtures (ranks, builds, the agreement table) are made once. PYTEST_WORKERS=0: no workers.
exec .venv/bin/python -m pytest -ra -n "${PYTEST_WORKERS:-auto}" --dist loadfile "$@"
