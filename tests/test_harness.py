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


def printed(popen, args, env, cwd=ROOT) -> dict:
    """The JSON object `python ARGS` printed, and whether a warm parent served it."""
    proc = popen([python(), *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    return {**json.loads(out), "served": isinstance(proc, zygote.Child)}


def what(popen, env) -> dict:
    return printed(popen, ["-c", SAYS], env)


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


def test_a_dependencies_parent_serves_children_with_or_without_what_importing_the_engine_sets(tmp_path):
    """sglang sets its cache folders with os.environ.setdefault when it is imported, so a test process
    that has imported it passes them on: a tree's child gets the same dependencies-only parent with or
    without them (its own engine sets the same values), and imports that tree's engine."""
    tree = next_release.tree(tmp_path / "tree", ["rename-alias"], "0.5.24")
    env = engine_env("0.5.23", PYTHONPATH=f"{tree}{os.pathsep}{ROOT}")
    parent = zygote._dependencies_for(python(), zygote._early(env))
    defaults = parent.engine_defaults
    assert "TRITON_CACHE_DIR" in defaults, defaults  # what importing 0.5.23 sets
    bare = {k: v for k, v in env.items() if k not in defaults}
    both = [zygote._dependencies_for(python(), zygote._early(e)) for e in (bare, {**bare, **defaults})]
    assert both[0] is both[1] is parent
    served = what(zygote.popen_once, {**bare, **defaults})
    assert served["served"] and served["sglang"] == str(tree / "sglang" / "__init__.py")


VALUES = ("import json, os, prometheus_client\n"
          "from prometheus_client import values\n"
          "prometheus_client.Gauge('probe', 'p', multiprocess_mode='mostrecent').set(1)\n"
          "folder = os.environ.get('PROMETHEUS_MULTIPROC_DIR')\n"
          "files = sorted(os.listdir(folder)) if folder else []\n"
          "print(json.dumps({'class': values.ValueClass.__name__, 'files': [f.replace(str(os.getpid()), 'PID') for f in files]}))")


def values_of(popen, env, folder) -> dict:
    found = printed(popen, ["-c", VALUES], env)
    for entry in folder.iterdir():
        entry.unlink()
    return found


def test_one_warm_parent_serves_children_with_and_without_a_metrics_folder(tmp_path):
    """prometheus_client picks where values live when it is imported (PROMETHEUS_MULTIPROC_DIR):
    a warm parent's child picks again in its own environment, as a fresh interpreter does."""
    folder = tmp_path / "prometheus"
    folder.mkdir()
    plain = engine_env("0.5.23")
    plain.pop("PROMETHEUS_MULTIPROC_DIR", None)
    metrics = {**plain, "PROMETHEUS_MULTIPROC_DIR": str(folder)}
    served = [values_of(zygote.popen, env, folder) for env in (metrics, plain, metrics)]
    fresh = [values_of(subprocess.Popen, env, folder) for env in (metrics, plain)]
    assert all(s["served"] for s in served) and not any(f["served"] for f in fresh)
    assert [{**s, "served": None} for s in served] == [{**f, "served": None} for f in fresh + fresh[:1]]
    assert fresh[0] == {"class": "MmapedValue", "files": ["gauge_mostrecent_PID.db"], "served": False}, fresh
    assert fresh[1] == {"class": "MutexValue", "files": [], "served": False}, fresh
    assert zygote._zygote_for(python(), metrics) is zygote._zygote_for(python(), plain)  # one parent for both


def test_a_safe_path_child_leaves_its_folder_off_the_path_as_a_fresh_interpreter_does(tmp_path):
    """`python -P` (no unsafe path first on sys.path) is served by a warm parent, its sys.path a fresh one's."""
    env = engine_env("0.5.23")
    paths = {}
    for options in ([], ["-P"]):
        for popen in (subprocess.Popen, zygote.popen):
            found = printed(popen, [*options, "-c", "import json, sys; print(json.dumps({'path': sys.path}))"], env, tmp_path)
            paths[tuple(options), found["served"]] = found["path"]
    assert paths[(), True] == paths[(), False] and paths[("-P",), True] == paths[("-P",), False], paths
    assert paths[(), False][0] == "" and paths[("-P",), False] == paths[(), False][1:], paths
