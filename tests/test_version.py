"""The engine's version when sglang is importable without its distribution metadata (a
source checkout on PYTHONPATH): read from the package's own version file."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import pathlib

from adapter import contract
from adapter.source_engine import read_version
from tests.engines import ENGINE_PATHS

PACKAGE = pathlib.Path(importlib.util.find_spec("sglang").origin).parent


def test_a_source_checkout_reports_its_own_version(tmp_path):
    (tmp_path / "sglang").symlink_to(PACKAGE)  # sglang/ without any dist-info beside it
    assert read_version(tmp_path) == "0.5.23"
    old = tmp_path / "old"
    old.mkdir()
    (old / "sglang").symlink_to(ENGINE_PATHS["0.5.18"][0] / "sglang")
    assert read_version(old) == "0.5.18"


def test_engine_version_falls_back_to_the_package_when_metadata_is_missing(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert contract.engine_version() == "0.5.23"
