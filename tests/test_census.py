"""The conservative census (every reference to a hazard's names): ordinary refactors of the real engine
modules, each refused with its file and line named, on the imported engine (through
tests/doctored.py) and through `entrypoint.py doctor --engine` on a doctored source tree."""

from __future__ import annotations

import json

import pytest

from sglang_dsv41_adapters.engine import census, proofs
from sglang_dsv41_adapters import folded_fence, group_min_memory, rank0_broadcast
from sglang_dsv41_adapters.framework import required, runtime
from sglang_dsv41_adapters.engine.installed import InstalledEngine
from sglang_dsv41_adapters.engine.source_engine import SourceEngine
from sglang_dsv41_adapters import cli
from sglang_dsv41_adapters.cli import EXIT_REFUSED
from tests import census_cases
from tests.census_cases import CASES
from harness.engines import ROOT, engine_env, python, release_sources
from harness import zygote
from harness.doctored import DoctoredEngine


ALL_CASES = [(release, case) for release in CASES for case in CASES[release]]


def assert_refused_at(outcome: dict, refactor, release: str, where: str) -> None:
    assert outcome["state"] == runtime.REFUSED, outcome
    reason = outcome["reason"]
    assert reason.startswith(f"{refactor.adapter} refused on sglang {release}: {refactor.module}:"), reason
    assert f"{where} refers to " in reason, (where, reason)


@pytest.fixture(scope="module")
def imported():
    """0.5.23 in this interpreter; 0.5.18 in a child interpreter that imports it."""
    done = zygote.run([python(), "-m", "tests.census_cases", "0.5.18"], cwd=ROOT, env=engine_env("0.5.18"),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT:"))
    return {"0.5.23": census_cases.imported("0.5.23"), "0.5.18": json.loads(line[len("RESULT:"):])}


@pytest.mark.parametrize("release,case", ALL_CASES)
def test_refused_when_imported(imported, release, case):
    outcome = imported[release][case]
    assert outcome["engine"] == release
    assert_refused_at(outcome, CASES[release][case], release, outcome["where"])


@pytest.mark.parametrize("release,case", ALL_CASES)
def test_refused_by_doctor_engine(tmp_path, release, case):
    """The refactor written into a copy of its release's sources and judged as `doctor --engine COPY` judges it
    (cli.report on the copy read with SourceEngine), here in this process, one tree per test: the command itself
    is run once per release below."""
    refactor = CASES[release][case]
    where = census_cases.source_tree(release_sources(release), refactor, tmp_path / "engine")
    report = cli.report({}, SourceEngine(tmp_path / "engine"), wanted=required.parse(["all"]))
    assert report["failed"] and cli.verdict(report) == "refused"  # doctor --require all exits 69
    row = next(a for a in report["adapters"] if a["adapter"] == refactor.adapter)
    assert_refused_at({"state": row["engine_check"], "reason": row["engine_check_reason"]}, refactor, release, where)


@pytest.mark.parametrize("release", sorted(CASES))
def test_the_doctor_engine_command_refuses_a_refactor(tmp_path, release):
    """The command end to end, on one refactor per release: exit 69, the reason in its JSON."""
    case = sorted(CASES[release])[0]
    refactor = CASES[release][case]
    where = census_cases.source_tree(release_sources(release), refactor, tmp_path / "engine")
    done = zygote.run([python(), "entrypoint.py", "doctor", "--json", "--strict", "--require", "all", "--engine", str(tmp_path / "engine")],
                          cwd=ROOT, env=engine_env("0.5.23"), capture_output=True, text=True, timeout=600)
    assert done.returncode == EXIT_REFUSED, done.stderr[-3000:]
    row = next(a for a in json.loads(done.stdout)["adapters"] if a["adapter"] == refactor.adapter)
    assert_refused_at({"state": row["engine_check"]["outcome"], "reason": row["engine_check"]["reason"]},
                      refactor, release, where)


@pytest.mark.parametrize("release", ["0.5.18", "0.5.23"])
def test_unmodified_release_has_every_reference_at_a_known_site(release):
    """The census finds the real sites (so it is not vacuous) and refuses none of them."""
    engine = SourceEngine(release_sources(release), version=release)
    assert runtime.engine_check(folded_fence.SURFACE, engine)[0] == runtime.APPLIED
    refs = census.references(engine, folded_fence.READERS)
    assert {(r.module, r.function) for r in refs} >= {
        (folded_fence.VERIFY, "TargetVerifyExecutor.accept_and_finalize"), (folded_fence.VERIFY, "DsparkVerifyEpilogue")}
    if release == "0.5.18":
        for adapter in (rank0_broadcast, group_min_memory):
            assert runtime.engine_check(adapter.SURFACE, engine)[0] == runtime.APPLIED
        probes = census.references(engine, {group_min_memory.HELPER})
        assert len({r.module for r in probes}) > 20  # the probe is used far beyond DSpark/DFlash


def test_buffers_read_from_the_readers():
    verify = SourceEngine(release_sources("0.5.23"), version="0.5.23").module(folded_fence.VERIFY)
    from sglang_dsv41_adapters.engine.contract import Contract

    assert folded_fence.epilogue_buffers(Contract(folded_fence.NAME, verify)) == {
        f"{f}_buf" for f in folded_fence.FIELDS} | {"block_accept_lens_buf"}


def test_a_docstring_or_comment_is_no_reference(tmp_path):
    tree = tmp_path / "engine"
    (tree / "sglang").mkdir(parents=True)
    (tree / "sglang" / "quiet.py").write_text('"""read_accept, in prose."""\n# read_accept(bs)\nx = 1\n')
    (tree / "sglang" / "loud.py").write_text('import operator\nget = operator.attrgetter("epilogue.read_accept")\n')
    (tree / "sglang" / "decorated.py").write_text('@hooks.on(read_accept)\ndef after(x):\n    return x\n')
    refs = census.references(SourceEngine(tree, version="x"), {"read_accept"})
    assert [(r.module, r.line, r.kind) for r in refs] == [("sglang.decorated", 1, census.NAME),
                                                          ("sglang.loud", 2, census.STRING)]


@pytest.fixture
def opened(monkeypatch) -> list:
    """The paths of the files the census opens, in order."""
    paths = []
    real_open = open
    monkeypatch.setattr(census, "open", lambda path, *a, **k: paths.append(path) or real_open(path, *a, **k),
                        raising=False)
    return paths


def test_census_scan_is_cached_per_process(opened):
    """The second look for the same names in the same files reads no file: its answer is kept."""
    engine = InstalledEngine()
    names = set(folded_fence.READERS)
    census.reset()
    first = census.references(engine, names)
    assert opened and first  # the first look read the files
    opened.clear()
    assert census.references(engine, names) == first
    assert opened == []


def test_a_copy_with_one_module_changed_reads_that_module_alone(monkeypatch, tmp_path, opened):
    """What a file's text holds is kept while its stat holds: the census of the installed engine with
    one module added reads that module alone, and a module changed since is read again."""
    monkeypatch.setattr(proofs, "RACY_NS", 0)  # keep what was read of a file written just now
    monkeypatch.setenv(proofs.ENV, "off")  # every answer from the files, none from the proof cache
    proofs.forget()
    census.reset()
    names = set(folded_fence.READERS)
    installed = census.files_holding(InstalledEngine(), names)
    assert len(opened) == len(InstalledEngine().files())
    late = tmp_path / "late_reader.py"
    late.write_text("def late(epilogue, bs):\n    return epilogue.read_accept(bs)\n")
    opened.clear()
    found = census.files_holding(DoctoredEngine({}, {"sglang.srt.late_reader": str(late)}), names)
    assert opened == [str(late)] and found == installed | {("sglang.srt.late_reader", str(late))}
    late.write_text("def late(epilogue, bs):\n    return None\n")  # another size: another stat
    other = tmp_path / "other.py"
    other.write_text("x = 1\n")
    opened.clear()
    found = census.files_holding(DoctoredEngine({}, {"sglang.srt.late_reader": str(late), "sglang.srt.other": str(other)}),
                                 names)
    assert sorted(opened) == sorted([str(late), str(other)]) and found == installed
    proofs.forget()
    census.reset()
