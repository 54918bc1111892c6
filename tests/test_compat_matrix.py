"""The compatibility matrix and the source-based engine check behind it."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil
import subprocess

import pytest

from sglang_dsv41_adapters import ADAPTERS, load
from sglang_dsv41_adapters.framework import runtime
from sglang_dsv41_adapters.engine.source_engine import SourceEngine
from sglang_dsv41_adapters.cli import EXIT_REFUSED
from harness.engines import ROOT, engine_env, python
from harness import zygote
from tests.log_lines import untimed

SITE_PACKAGES = pathlib.Path(importlib.util.find_spec("sglang").origin).parent.parent


def test_committed_matrix_matches_the_release_wheels():
    """Recomputed from the real wheels of 0.5.16 onward (downloaded once into .engines/)."""
    done = zygote.run([python(), "tools/compat_matrix.py", "--check"], cwd=ROOT, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "docs/COMPATIBILITY.md matches the" in done.stderr


@pytest.mark.parametrize("name", ADAPTERS)
def test_source_check_agrees_with_the_import_check_on_0_5_23(name):
    adapter = load(name)
    from_source = runtime.engine_check(adapter, SourceEngine(SITE_PACKAGES))
    assert from_source == runtime.engine_check(adapter)
    assert from_source[0] != runtime.REFUSED


def drifted_tree(tmp_path: pathlib.Path) -> pathlib.Path:
    """The 0.5.23 speculative package and metadata, with AcceptOuts given one more field."""
    tree = tmp_path / "engine"
    shutil.copytree(SITE_PACKAGES / "sglang" / "srt" / "speculative", tree / "sglang" / "srt" / "speculative")
    shutil.copytree(next(SITE_PACKAGES.glob("sglang-*.dist-info")), tree / "sglang-0.5.23.dist-info")
    verify = tree / "sglang" / "srt" / "speculative" / "dspark_components" / "dspark_verify.py"
    text = verify.read_text()
    verify.write_text(text.replace("    out_tokens: torch.Tensor\n", "    out_tokens: torch.Tensor\n    draft_ids: torch.Tensor\n", 1))
    return tree


def test_doctor_refuses_a_drifted_engine_it_has_not_imported(tmp_path):
    done = zygote.run([python(), "entrypoint.py", "doctor", "--json", "--strict", "--require", "DSV41_FOLDED_FENCE", "--engine", str(drifted_tree(tmp_path))],
                          cwd=ROOT, env=engine_env("0.5.23"), capture_output=True, text=True, timeout=300)
    assert done.returncode == EXIT_REFUSED, done.stderr[-3000:]
    report = json.loads(done.stdout)
    fence = next(a for a in report["adapters"] if a["adapter"] == "folded_fence")
    assert fence["engine_check"]["outcome"] == "refused"
    assert fence["engine_check"]["reason"].startswith(
        "folded_fence refused on sglang 0.5.23: sglang.srt.speculative.dspark_components.dspark_verify:AcceptOuts: fields are")
    assert "'draft_ids'" in fence["engine_check"]["reason"]
    # Read from sources only: no adapter line was printed, nothing was imported or applied.
    assert not [line for line in untimed(done.stderr) if "[sglang-adapters]" in line]  # progress lines aside


SHAPES = {  # msgspec structs and dataclasses inheriting fields, as an engine module might declare them
    "sglang/srt/bases.py": (
        "import dataclasses\n\nimport msgspec\n\n\n"
        "class Remote(msgspec.Struct):\n    r: int = 0\n\n\n"
        "@dataclasses.dataclass\nclass RemoteData:\n    x: int = 0\n"),
    "sglang/srt/shapes.py": (
        "import dataclasses\nimport typing\n\nimport msgspec\n\nfrom sglang.srt import bases\n"
        "from sglang.srt.bases import Remote, RemoteData\n\n\n"
        "class A(msgspec.Struct):\n    a: int = 0\n    b: int = 0\n\n\n"
        "class Mixin:\n    __slots__ = ()\n    m: typing.ClassVar[int] = 0\n\n    def hello(self):\n        pass\n\n\n"
        "class B(A):\n    c: int = 1\n    a: int = 5  # declared again: keeps its place\n\n\n"
        "class C(B, Mixin):\n    d: int = 2\n    k: typing.ClassVar[int] = 0\n\n\n"
        "class D(Remote):\n    e: int = 0\n\n\n"
        "class E(bases.Remote):\n    f: int = 0\n\n\n"
        "class Plain:\n    p: int = 0  # a plain class's annotation: no field\n\n\n"
        "@dataclasses.dataclass\nclass DA:\n    a: int = 0\n    b: int = 0\n\n\n"
        "@dataclasses.dataclass\nclass DB(DA, Plain):\n    c: int = 1\n    a: int = 5\n\n\n"
        "class NotDecorated(DB):\n    z: int = 3  # no dataclass of its own: DB's fields\n\n\n"
        "@dataclasses.dataclass\nclass DR(RemoteData):\n    y: int = 0\n"),
    "sglang/__init__.py": "", "sglang/srt/__init__.py": "",
}


def fields_of(cls):
    found = getattr(cls, "__struct_fields__", None)
    return list(found) if found is not None else list(getattr(cls, "__dataclass_fields__", {}))


def test_inherited_fields_read_from_source_are_those_python_gives(tmp_path):
    """Bases in the same module and in another of the tree, in MRO order: what msgspec and
    dataclasses give the classes when the module is imported (a child interpreter with the
    tree first on its path), the source reader gives them without importing."""
    for name, text in SHAPES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    code = ("import inspect, json, sglang.srt.shapes as m; print(json.dumps({n: list(getattr(c, '__struct_fields__', None) "
            "or getattr(c, '__dataclass_fields__', {})) for n, c in vars(m).items() if inspect.isclass(c) "
            "and c.__module__ == m.__name__}))")
    done = subprocess.run([python(), "-c", code], cwd=tmp_path, env={**engine_env("0.5.23"), "PYTHONPATH": str(tmp_path)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    imported = json.loads(done.stdout)
    assert imported["C"] == ["a", "b", "c", "d"] and imported["NotDecorated"] == ["a", "b", "c"]  # Python's own order
    module = SourceEngine(tmp_path, version="0.5.23").module("sglang.srt.shapes")
    assert {name: fields_of(getattr(module, name)) for name in imported} == imported


def test_a_release_newer_than_the_table_is_judged_without_a_code_change(tmp_path, monkeypatch, capsys):
    """The registry offers a release the committed table does not hold (here a 0.5.24 built from
    0.5.23 with upstream's open fixes): --check judges it, says so, and still compares the
    committed rows; writing the table adds its row."""
    import sys

    from harness import next_release

    sys.path.insert(0, str(ROOT / "tools"))
    import compat_matrix

    newer = next_release.tree(tmp_path / "0.5.24", ["39954-pr", "40246-pr", "31195"], "0.5.24")
    trees = {"0.5.23": SITE_PACKAGES, "0.5.24": newer}
    monkeypatch.setattr(compat_matrix, "source_tree", lambda version: trees[version])
    monkeypatch.setattr(compat_matrix, "DOC", tmp_path / "COMPATIBILITY.md")
    monkeypatch.setattr(compat_matrix, "registry_releases", lambda: ["0.5.23"])
    assert compat_matrix.main([]) == 0  # the committed table: 0.5.23 alone
    monkeypatch.setattr(compat_matrix, "registry_releases", lambda: ["0.5.23", "0.5.24"])
    capsys.readouterr()
    assert compat_matrix.main(["--check"]) == 0
    said = capsys.readouterr().err
    assert "new on the registry: sglang 0.5.24: folded_fence applied, rank0_broadcast applied, " \
           "group_min_memory superseded, tp_divergence applied, known_bad_config superseded" in said
    assert "matches the 1 releases" in said
    assert compat_matrix.main([]) == 0
    assert "| 0.5.24 | applied | applied | superseded | applied | superseded |" in (tmp_path / "COMPATIBILITY.md").read_text()
