"""The engine's version is a label read from the sglang tree that is imported (or read): its
own generated _version.py, else a dist-info beside it whose RECORD lists its files, else
the literal its version.py falls back to; never another installation's metadata. No
verdict depends on it: an unreleased build is judged by its code."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import pathlib
import shutil

from sglang_dsv41_adapters.engine import installed
from sglang_dsv41_adapters.engine.source_engine import Label, read_label
from harness.engines import ENGINE_PATHS

PACKAGE = pathlib.Path(importlib.util.find_spec("sglang").origin).parent


def test_a_source_checkout_reports_its_own_version(tmp_path):
    (tmp_path / "sglang").symlink_to(PACKAGE)  # sglang/ without any dist-info beside it
    assert read_label(tmp_path) == Label("0.5.23", "sglang/_version.py")
    old = tmp_path / "old"
    old.mkdir()
    (old / "sglang").symlink_to(ENGINE_PATHS["0.5.18"][0] / "sglang")
    assert read_label(old) == Label("0.5.18", "sglang/_version.py")


def tree_without_version_file(root: pathlib.Path) -> pathlib.Path:
    """sglang/ with the engine's real version.py but no generated _version.py (a checkout
    nobody built): the engine would ask importlib.metadata, whoever answers."""
    (root / "sglang").mkdir(parents=True)
    (root / "sglang" / "__init__.py").write_text("")
    shutil.copyfile(PACKAGE / "version.py", root / "sglang" / "version.py")
    return root


def dist_info(root: pathlib.Path, version: str, record: str) -> None:
    dist = root / f"sglang-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    (dist / "RECORD").write_text(record)


def test_only_metadata_that_lists_this_tree_labels_it(tmp_path):
    root = tree_without_version_file(tmp_path / "checkout")
    # No file states a version but version.py's last fallback.
    assert read_label(root) == Label("0.0.0.dev0", "sglang/version.py")
    # A dist-info whose RECORD lists other files is another installation's: ignored.
    dist_info(root, "0.5.22", "other/__init__.py,sha256=x,1\n")
    assert read_label(root) == Label("0.0.0.dev0", "sglang/version.py")
    # One whose RECORD lists this tree's files is its own.
    dist_info(root, "0.5.21", "sglang/__init__.py,sha256=x,1\nsglang/version.py,sha256=y,2\n")
    assert read_label(root) == Label("0.5.21", "sglang-0.5.21.dist-info")


def test_metadata_that_is_no_regular_file_is_not_read(tmp_path):
    """A FIFO named RECORD (doctor --engine reads untrusted trees) would hang a reader."""
    import os

    root = tree_without_version_file(tmp_path / "checkout")
    (root / "sglang-0.5.21.dist-info").mkdir()
    os.mkfifo(root / "sglang-0.5.21.dist-info" / "RECORD")
    assert read_label(root) == Label("0.0.0.dev0", "sglang/version.py")


def test_the_installed_label_never_comes_from_importlib_metadata(monkeypatch):
    """importlib.metadata answers for whichever installation it finds first; the label comes
    from the tree that is imported."""
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.9.9")
    assert installed.engine_version() == "0.5.23"
    assert installed.InstalledEngine().label == Label("0.5.23", "sglang/_version.py")
    assert installed.InstalledEngine().origin == PACKAGE.parent


def test_what_counts_as_a_release():
    assert [Label(v, None).released for v in ("0.5.23", "0.5.23.post1", "1.0.0")] == [True] * 3
    assert [Label(v, None).released for v in ("0.0.0.dev0", "0.5.24rc1", "0.5", "unknown", "0.5.23+g1a2b")] == [False] * 5


def test_a_wheel_without_a_version_file_is_labelled_by_its_own_dist_info(tmp_path):
    import zipfile

    from sglang_dsv41_adapters.engine.source_engine import open_engine

    wheel = tmp_path / "sglang-0.5.21-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("sglang/__init__.py", "")
        archive.write(PACKAGE / "version.py", "sglang/version.py")
        archive.writestr("sglang-0.5.21.dist-info/METADATA", "Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.21\n")
        archive.writestr("sglang-0.5.21.dist-info/RECORD", "sglang/__init__.py,,\nsglang/version.py,,\n")
    engine = open_engine(wheel, tmp_path / "unpacked")
    assert engine.label == Label("0.5.21", "sglang-0.5.21.dist-info") and engine.origin == wheel
