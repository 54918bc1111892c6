"""An unreleased build (a preview image reporting 0.0.0.dev0) is judged by its code: a
release's own sources labelled 0.0.0.dev0 get every outcome the release gets, and doctor
and each process's lines say "unreleased build, judged by its code" with where the engine
came from. No verdict reads the label."""

from __future__ import annotations

import subprocess

import pytest

from sglang_dsv41_adapters import ADAPTERS, load
from sglang_dsv41_adapters.framework import runtime
from sglang_dsv41_adapters.engine.source_engine import UNRELEASED, SourceEngine
from harness.engines import ENGINE_PATHS, PREVIEW, ROOT, engine_env, python, relabelled, release_sources
from harness import zygote

COMBOS = [
    {},
    {"DSV41_FOLDED_FENCE": "1"},
    {"DSV41_SPEC_TP_SYNC": "all"},
    {"DSV41_SPEC_TP_SYNC": "all,-dspark-draft", "DSV41_GROUP_MIN_MEM": "1", "DSV41_TP_DIVERGENCE": "1"},
    {"DSV41_SPEC_TP_SYNC": "all", "SGLANG_SPEC_TP_SYNC": "init"},
    {"DSV41_FOLDED_FENCE": "1", "DSV41_SPEC_TP_SYNC": "rng", "DSV41_GROUP_MIN_MEM": "1", "DSV41_TP_DIVERGENCE": "1"},
    {"DSV41_TP_DIVERGENCE": "1"},
]

TREES = {"0.5.23": lambda: release_sources("0.5.23"), "0.5.18": lambda: ENGINE_PATHS["0.5.18"][0]}


def verdicts(engine) -> list:
    """Every outcome and engine check on `engine`, with its root and label taken out of the
    reasons (they name the files and the release)."""
    def plain(text: str) -> str:
        return text.replace(str(engine.root), "<root>").replace(f"sglang {engine.version}", "sglang <label>")

    rows = [[(o.adapter, o.state, plain(o.reason)) for o in runtime.decide(environ, engine).outcomes]
            for environ in COMBOS]
    checks = [(name, *map(plain, runtime.engine_check(load(name), engine))) for name in ADAPTERS]
    return rows + [checks]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("release", sorted(TREES))
def test_an_unreleased_build_gets_every_outcome_its_release_gets(tmp_path, release):
    released = SourceEngine(TREES[release]())
    preview = SourceEngine(relabelled(TREES[release](), tmp_path / "preview"))
    assert (released.version, preview.version) == (release, PREVIEW)
    assert not preview.label.released and preview.label.source == "sglang/_version.py"
    assert verdicts(preview) == verdicts(released)
    # Each process's lines say that the label is not a release and that it was judged by its code.
    for line in runtime.decide({"DSV41_FOLDED_FENCE": "1"}, preview).lines():
        assert line.endswith(f" (sglang {PREVIEW}: {UNRELEASED})") and len(line) < 200, line


def test_doctor_engine_on_an_unreleased_build_says_it_is_judged_by_its_code(tmp_path):
    tree = relabelled(release_sources("0.5.23"), tmp_path / "preview")
    done = zygote.run([python(), "entrypoint.py", "doctor", "--strict", "--engine", str(tree)], cwd=ROOT,
                          env=engine_env("0.5.23", DSV41_FOLDED_FENCE="1"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    header = done.stdout.splitlines()[2:4]  # after the verdict
    assert header == [f"sglang {PREVIEW}: {UNRELEASED}",
                      f"engine at {tree}; label {PREVIEW} from {tree}/sglang/_version.py; "
                      "verdicts are judged by the engine's code, not by its label"]
    fence = next(line.split() for line in done.stdout.splitlines() if line.startswith("folded_fence "))
    assert fence == ["folded_fence", "DSV41_FOLDED_FENCE", "'1'", "applied", "applied"]


def test_an_installed_unreleased_build_first_on_the_path_is_labelled_by_its_own_tree(tmp_path):
    """0.5.18's code labelled 0.0.0.dev0, without metadata, first on PYTHONPATH: the venv's
    0.5.23 metadata must not label it (importlib.metadata would)."""
    tree = relabelled(ENGINE_PATHS["0.5.18"][0], tmp_path / "preview")
    env = engine_env("0.5.18", DSV41_FOLDED_FENCE="1")
    env["PYTHONPATH"] = env["PYTHONPATH"].replace(str(ENGINE_PATHS["0.5.18"][0]), str(tree))
    done = zygote.run([python(), "entrypoint.py", "doctor", "--strict"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[2:4] == [
        f"sglang {PREVIEW}: {UNRELEASED}",
        f"engine at {tree}/sglang; label {PREVIEW} from {tree}/sglang/_version.py; "
        "verdicts are judged by the engine's code, not by its label"]
    # 0.5.18's code: the fence has one escape route there (0.5.23 has three).
    assert "folded_fence: applied - fenced 1 escape route; graph logits left in place" in done.stdout.splitlines()
    assert "DsparkSamplingAcceptGraph.run" not in done.stdout
