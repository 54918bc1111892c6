"""Where the pinned engine releases live for the tests (scripts/setup.sh installs them)."""

from __future__ import annotations

import atexit
import os
import pathlib
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
SETTINGS = ("DSV41_ADAPTERS_PROOF_CACHE", "DSV41_ADAPTERS_SNAPSHOT_KERNEL")  # engine.settings.NAMES
# 0.5.23 is the venv's own sglang; 0.5.18 sits in --target folders put first on the path.
ENGINE_PATHS = {
    "0.5.23": [],
    "0.5.18": [ROOT / ".engines" / "sglang-0.5.18", ROOT / ".engines" / "deps-0.5.18"],
}


def engine_env(release: str, **extra: str) -> dict[str, str]:
    """Environment for a child interpreter that imports `release` of the engine."""
    paths = [str(p) for p in ENGINE_PATHS[release]] + [str(ROOT)]
    # the pack's flags are each test's own; its settings (the proof cache's folder) pass through
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_") or k in SETTINGS}
    env["PYTHONPATH"] = os.pathsep.join(paths + [env["PYTHONPATH"]] if env.get("PYTHONPATH") else paths)
    env.update(extra)
    return env


def python() -> str:
    return sys.executable


def release_sources(release: str) -> pathlib.Path:
    """A release's sources, read not imported (`doctor --engine`, the compatibility matrix),
    under .engines/src/<release>: fetched from the registry the first time (tools/compat_matrix.py)."""
    return _compat_matrix().source_tree(release)


def release_wheel(release: str) -> pathlib.Path:
    """A release's wheel under .engines/wheels, fetched from the registry the first time."""
    return _compat_matrix().release_wheel(release)


def _compat_matrix():
    tools = str(ROOT / "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    import compat_matrix

    return compat_matrix


_SEEDS: dict = {}  # a tree -> this process's copy of it, which linked copies link to
BINARIES = (".pyc", ".so")  # never hashed by the proofs: linked even into the seed


def linked_copy(tree: pathlib.Path, into: pathlib.Path) -> pathlib.Path:
    """`tree` copied into `into` as hard links (quick, and the bytecode cache stays valid), made to
    a copy of `tree` this process keeps instead of to `tree` itself: a new link changes its file's
    change time, which the proof cache takes for a changed file (engine.proofs), so linking to
    the installed engine would have every later process hash its 4,700 files again. Copied
    where the file system allows no link."""
    tree = pathlib.Path(tree).resolve()
    if tree not in _SEEDS:
        seed = pathlib.Path(tempfile.mkdtemp(prefix="engine-seed-")) / tree.name
        atexit.register(shutil.rmtree, seed.parent, True)
        shutil.copytree(tree, seed, copy_function=lambda a, b: (_link(a, b) if a.endswith(BINARIES)
                                                                 else shutil.copy2(a, b)))  # times kept
        _SEEDS[tree] = seed
    shutil.copytree(_SEEDS[tree], into, copy_function=_link)
    return pathlib.Path(into)


def _link(source, destination):
    try:
        os.link(source, destination)
    except OSError:  # another file system
        shutil.copy2(source, destination)


PREVIEW = "0.0.0.dev0"  # what a preview image built from an unmerged branch reports


def relabelled(tree: pathlib.Path, into: pathlib.Path, version: str = PREVIEW) -> pathlib.Path:
    """A copy of the engine whose sglang/ sits in `tree`, labelled `version` as a preview
    build is: its generated sglang/_version.py says so and no dist-info sits beside it.
    The code is the release's, byte for byte. Returns `into`, which then holds sglang/."""
    shutil.copytree(tree / "sglang", into / "sglang")  # times kept: the bytecode cache stays valid
    (into / "sglang" / "_version.py").write_text(
        f"__version__ = version = {version!r}\n__version_tuple__ = version_tuple = {tuple(version.split('.'))!r}\n"
        "__commit_id__ = commit_id = None\n")
    return into


def served_metrics(folder) -> str:
    """What the engine's /metrics serves over a PROMETHEUS_MULTIPROC_DIR `folder`: the route
    sglang's own add_prometheus_middleware mounts on its app with --enable-metrics (a
    multiprocess collector over the files every process wrote there), asked over HTTP."""
    from fastapi import FastAPI
    from sglang.srt.utils.common import add_prometheus_middleware
    from starlette.testclient import TestClient

    saved = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(folder)  # the collector reads its folder from there
    try:
        app = FastAPI()
        add_prometheus_middleware(app)
    finally:
        if saved is None:
            del os.environ["PROMETHEUS_MULTIPROC_DIR"]
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = saved
    with TestClient(app) as client:
        response = client.get("/metrics")
    assert response.status_code == 200, response.text
    return response.text


def metric_samples(text: str, prefix: str) -> dict:
    """(name, sorted labels) -> value for every sample named `prefix`... in Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples if s.name.startswith(prefix)}
