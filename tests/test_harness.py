"""The test harness's warm parents (harness/zygote.py) start children that are what a fresh
interpreter would be: a tree's child imports that tree's engine, with the import path a fresh
interpreter builds, and an environment whose path would shadow what a parent imported gets a
fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess

from harness import next_release, zygote
from harness.engines import ROOT, engine_env, python

SAYS = ("import json, sys, sglang, transformers\n"
        "print(json.dumps({'path': sys.path, 'sglang': sglang.__file__, 'transformers': transformers.__file__}))")


def what(popen, env) -> dict:
    proc = popen([python(), "-c", SAYS], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    return {**json.loads(out), "served": isinstance(proc, zygote.Child)}


def test_a_trees_child_imports_that_trees_engine_as_a_fresh_interpreter_would(tmp_path):
    tree = next_release.tree(tmp_path / "tree", ["rename-alias"], "0.5.24")
    env = engine_env("0.5.23", PYTHONPATH=f"{tree}{os.pathsep}{ROOT}")
    fresh, served, warm = what(subprocess.Popen, env), what(zygote.popen_once, env), what(zygote.popen, env)
    assert served["served"] and warm["served"] and not fresh["served"]
    assert fresh["sglang"] == served["sglang"] == warm["sglang"] == str(tree / "sglang" / "__init__.py")
    assert fresh["path"] == served["path"] == warm["path"]
    assert fresh["transformers"] == served["transformers"]


def test_a_path_that_shadows_a_dependency_gets_a_fresh_interpreter():
    """0.5.18's folders carry their own transformers: no parent that imported the venv's serves them."""
    env = engine_env("0.5.18")
    once = what(zygote.popen_once, env)
    assert not once["served"]
    assert once["transformers"].startswith(str(ROOT / ".engines" / "deps-0.5.18")), once["transformers"]
