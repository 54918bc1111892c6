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
    done = zygote.run([python(), "entrypoint.py", "doctor", "--json", "--strict", "--engine", str(drifted_tree(tmp_path))],
                          cwd=ROOT, env=engine_env("0.5.23"), capture_output=True, text=True, timeout=300)
    assert done.returncode == EXIT_REFUSED, done.stderr[-3000:]
    report = json.loads(done.stdout)
    fence = next(a for a in report["adapters"] if a["adapter"] == "folded_fence")
    assert fence["engine_check"]["outcome"] == "refused"
    assert fence["engine_check"]["reason"].startswith(
        "folded_fence refused on sglang 0.5.23: sglang.srt.speculative.dspark_components.dspark_verify:AcceptOuts: fields are")
    assert "'draft_ids'" in fence["engine_check"]["reason"]
    # Read from sources only: no adapter line was printed, nothing was imported or applied.
    assert "[sglang-adapters]" not in done.stderr
