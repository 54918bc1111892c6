"""What the README and the recipe tell deployers, checked against the code and the
compatibility matrix: the release table, the exit statuses, the contributors' commands,
the release claims on 0.5.16, the bisection example against the recipe's env file, the
licence, the changelog and the version the image is tagged with (the recipe's scripts:
tests/test_recipe.py)."""

from __future__ import annotations

import re
import sys
import types

from sglang_dsv41_adapters import cli
from sglang_dsv41_adapters.framework import runtime
from sglang_dsv41_adapters.engine.source_engine import SourceEngine
from harness import zygote
from harness.engines import ROOT, release_sources

sys.path.insert(0, str(ROOT / "tools"))
import doctor_sample  # noqa: E402
import release_table  # noqa: E402

README = (ROOT / "README.md").read_text()
RECIPE = ROOT / "recipes" / "dsv41-flash-tp4-dspark"


def test_release_tables_are_generated_from_the_matrix():
    assert release_table.main(["--check"]) == 0
    matrix = release_table.MATRIX.read_text()
    want = release_table.table(matrix)
    # judged without the server arguments: the memory probe is the pack's where DP attention may leave it per rank;
    # at its broadest setting (all,31) DSV41_SPEC_TP_SYNC patches site 31 beside the engine's SpecTpSync sites
    assert "| 0.5.17 | `DSV41_FOLDED_FENCE`, `DSV41_SPEC_TP_SYNC`, `DSV41_GROUP_MIN_MEM` | - | - | " \
           "`DSV41_KNOWN_BAD_CONFIG` |" in want
    # the known-bad guard: the write pad's fix from 0.5.18; before it, the deployment's block size decides at launch
    assert "| 0.5.18 - 0.5.23 | `DSV41_FOLDED_FENCE`, `DSV41_SPEC_TP_SYNC`, `DSV41_GROUP_MIN_MEM` | " \
           "`DSV41_KNOWN_BAD_CONFIG` | - | - |" in want
    # A matrix change shows up as a stale table.
    changed = matrix.replace("| 0.5.23 | applied |", "| 0.5.23 | refused |")
    assert changed != matrix and release_table.table(changed) != want
    assert "| 0.5.23 | `DSV41_SPEC_TP_SYNC`, `DSV41_GROUP_MIN_MEM` | `DSV41_KNOWN_BAD_CONFIG` | `DSV41_FOLDED_FENCE` | - |" \
        in release_table.table(changed)


def test_the_doctor_samples_are_doctors_output(monkeypatch):
    """The README's doctor section shows the default report of the recipe's deployment with every flag on, and
    links the --verbose one (docs/doctor.md): both what doctor prints for it today, and the check can fail."""
    # its two doctor runs start from a parent that imported the engine (harness/zygote.py): the same runs, less waiting
    monkeypatch.setattr(doctor_sample, "subprocess", types.SimpleNamespace(run=zygote.run))
    start = README.index("\n## doctor\n")
    section = README[start:README.index("\n## ", start + 1)]
    assert doctor_sample.BEGIN in section and "[docs/doctor.md](docs/doctor.md)" in section and "--verbose" in section
    assert doctor_sample.main(["--check"]) == 0
    short = doctor_sample.BLOCK.search(section)[1]
    assert "  outcome: " not in short and "folded_fence: applied - fenced " in short
    verbose = doctor_sample.BLOCK.search((ROOT / "docs" / "doctor.md").read_text())[1]
    assert "\nfolded_fence: detach DSpark" in verbose and "\n  outcome: fenced TargetVerifyExecutor" in verbose
    assert doctor_sample.stale(ROOT / "README.md", short.replace("applied - fenced", "applied - patched"))


def test_the_0_5_16_claim_holds_on_its_sources():
    engine = SourceEngine(release_sources("0.5.16"))
    outcome = lambda value: runtime.decide({"DSV41_SPEC_TP_SYNC": value}, engine, names=("rank0_broadcast",)).outcomes[0].state
    assert (outcome("all"), outcome("all,-dspark-draft")) == (runtime.REFUSED, runtime.APPLIED)
    recipe = (RECIPE / "README.md").read_text()
    assert "on 0.5.16 `DSV41_SPEC_TP_SYNC=all` is refused, use\n`all,-dspark-draft` there" in recipe
    assert "On 0.5.16 `DSV41_SPEC_TP_SYNC=all` is refused" in README


def test_readme_exit_statuses_are_the_commands():
    block = README[README.index("<!-- exit-statuses"):README.index("<!-- /exit-statuses -->")]
    rows = re.findall(r"^\| (\d+) \| (.+) \|$", block, re.M)
    assert [(int(code), meaning) for code, meaning in rows] == list(cli.EXIT_STATUSES)


def test_readme_is_for_deployers_first_and_keeps_the_contributors_two_commands():
    sections = re.findall(r"^## (.+)$", README, re.M)
    assert sections[:3] == ["Do you need it?", "Quick start (Docker)", "Checking a running container"]
    assert sections.index("For contributors: the two commands") > sections.index("Rollout, canary, rollback")
    assert "bash scripts/setup.sh && .venv/bin/python entrypoint.py doctor    #" in README
    assert "\nbash scripts/test.sh   " in README
    assert (ROOT / "scripts" / "setup.sh").exists() and (ROOT / "scripts" / "test.sh").exists()



def test_readme_links_every_docs_page_and_every_link_resolves():
    """The README is the deployer's page: the rest lives under docs/, each page listed under "More"; a
    relative link in the README or a docs page that names no file (a page moved or renamed) fails."""
    more = README[README.index("\n## More\n"):]
    pages = sorted(path.name for path in (ROOT / "docs").iterdir() if path.suffix in (".md", ".json"))
    assert [page for page in pages if f"](docs/{page})" not in more] == []
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text()):
            assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)} links {target}, which is not there"

# --- the bisection example, with the recipe's env file ------------------------------------------

def test_the_bisection_example_works_with_the_recipes_env_file():
    """The recipe's bisection step, as run.sh passes it (--env-file adapters.env, then the
    example's -e, which wins), is accepted on the image's engine and hands the selection over."""
    from tests.deployment_image import ENV_FILE, read_env_file

    text = (RECIPE / "README.md").read_text()
    (example,) = re.findall(r'^   EXTRA_ENV="-e (\w+)=(\S+)" MODEL_DIR=\.\.\. recipes/dsv41-flash-tp4-dspark/run\.sh$', text,
                            re.M)
    flag, value = example
    environ = read_env_file(ENV_FILE) | {flag: value}
    decision = runtime.decide(environ)
    assert not decision.refused, decision.reasons
    # in the engine's own grammar, as written: every site the engine would keep under it stays on
    assert decision.plans["rank0_broadcast"].env == {"SGLANG_SPEC_TP_SYNC": value}
    # what the example said before: the engine's own switch beside the env file's selection
    conflict = runtime.decide(read_env_file(ENV_FILE) | {"SGLANG_SPEC_TP_SYNC": value})
    assert conflict.refused and not conflict.flag_errors  # 69


# --- adoption: licence, changelog, the version the image carries --------------------------------

def pack_version() -> str:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_the_licence_is_apache_2_0_as_sglangs():
    import tomllib

    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"] and "END OF TERMS AND CONDITIONS" in text
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert (project["license"], project["license-files"]) == ("Apache-2.0", ["LICENSE"])
    assert 'org.opencontainers.image.licenses="Apache-2.0"' in (ROOT / "docker" / "Dockerfile").read_text()


def test_the_changelog_has_the_version():
    sections = re.findall(r"^## \[([^\]]+)\]", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert sections[0] == "Unreleased" and pack_version() in sections


def test_deepseek_v41_code_first_appears_in_0_5_21():
    """The recipe's claim, on every release's sources: no V4.1 model type before 0.5.21, V4 in all."""
    from harness.engines import ENGINE_PATHS

    trees = {release: release_sources(release) for release in ("0.5.16", "0.5.17", "0.5.19", "0.5.20", "0.5.21",
                                                               "0.5.22", "0.5.23")}
    trees["0.5.18"] = ENGINE_PATHS["0.5.18"][0]
    configs = lambda tree: tree / "sglang" / "srt" / "configs"  # noqa: E731
    has_v41 = {release: (configs(tree) / "deepseek_v41.py").is_file()
               and "deepseek_v41" in (configs(tree) / "model_config.py").read_text() for release, tree in trees.items()}
    assert sorted(r for r, found in has_v41.items() if found) == ["0.5.21", "0.5.22", "0.5.23"]
    assert all((tree / "sglang" / "srt" / "models" / "deepseek_v4.py").is_file() for tree in trees.values())
    recipe = (RECIPE / "README.md").read_text()
    assert "DeepSeek-V4.1 code first appears in sglang 0.5.21" in recipe and "0.0.0.dev0" in recipe


def test_every_image_tag_names_this_pack_and_engine():
    """Wherever the docs, the recipe and the manifests name the image, the tag carries the
    version in pyproject.toml and the engine the image is built on."""
    import importlib.metadata

    want = f"sglang-dsv41:{importlib.metadata.version('sglang')}-cu130-pack{pack_version()}"
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "docker" / "Dockerfile", *RECIPE.rglob("*")]
    tags = {(path.name, tag) for path in files if path.is_file()
            for tag in re.findall(r"sglang-dsv41:[\w.]+-cu\d+-pack[\w.]+", path.read_text())}
    assert {name for name, _ in tags} >= {"README.md", "deployment.md", "Dockerfile", "run.sh", "deployment.yaml",
                                          "leaderworkerset.yaml"}
    assert {tag for _, tag in tags} == {want}, tags
