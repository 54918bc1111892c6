"""Every adapter's ledger against the compatibility matrix (docs/COMPATIBILITY.md, itself
recomputed from the release wheels by tests/test_compat_matrix.py), and the retired flags."""

from __future__ import annotations

import re

import pytest

from harness.engines import ROOT
from sglang_dsv41_adapters import ADAPTERS, load
from sglang_dsv41_adapters.framework import ledger, runtime
from sglang_dsv41_adapters.framework.topology import REPRESENTATIVE

MATRIX = (ROOT / "docs" / "COMPATIBILITY.md").read_text()


def release(version: str) -> tuple:
    return tuple(int(part) for part in version.split("."))


def by_layout() -> dict:
    """{release: {adapter: {layout: outcome}}} from the matrix's by-deployment table."""
    section = MATRIX[MATRIX.index("## By deployment"):MATRIX.index("## Reasons")]
    rows = [line for line in section.splitlines() if re.match(r"\| \d+\.\d+\.\d+ \|", line)]
    table = {}
    for line in rows:
        version, *cells = [cell.strip() for cell in line.strip("|").split("|")]
        table[version] = {name: dict(zip(REPRESENTATIVE, cell.split(" / "))) for name, cell in zip(ADAPTERS, cells)}
    return table


TABLE = by_layout()


def test_the_ledgers_layouts_are_the_matrixs():
    assert tuple(REPRESENTATIVE) == ledger.EVERY_LAYOUT
    assert len(TABLE) >= 8 and all(len(row) == len(ADAPTERS) for row in TABLE.values())


@pytest.mark.parametrize("name", ADAPTERS)
def test_an_adapter_is_superseded_exactly_where_its_released_fixes_reach(name):
    fixes = load(name).ledger.fixes
    for version, row in TABLE.items():
        for layout, outcome in row[name].items():
            reached = any(fix.first_release is not None and release(version) >= release(fix.first_release)
                          and layout in fix.layouts for fix in fixes)
            assert (outcome == "superseded") == reached, (name, version, layout, outcome)


@pytest.mark.parametrize("name", ADAPTERS)
def test_code_kept_for_older_releases_serves_releases_before_the_first_fix(name):
    surface = load(name)
    ends = surface.ledger.legacy_ends
    for path, span in surface.ledger.legacy.items():
        low, high = (release(v) for v in span.split("-"))
        assert ends is not None and high < release(ends), (name, path, span)
        first = release(ends)
        served = [v for v in TABLE if low <= release(v) <= high]
        assert served and all(TABLE[v][name]["tp"] != "superseded" for v in served), (name, path, served)
        # every matrix release before the first fix is served by it: nothing older is left uncovered
        assert served == [v for v in TABLE if release(v) < first], (name, path)


def test_a_retired_flag_is_said_not_refused(monkeypatch):
    monkeypatch.setitem(ledger.RETIRED_FLAGS, "DSV41_OLD_FIX",
                        "retired in pack 0.3.0: every supported release has the fix; remove it from the env file")
    environ = {"DSV41_OLD_FIX": "1"}
    assert runtime.unknown_flags(environ) == []
    (note,) = runtime.ignored_note(environ)
    assert note.startswith("ignored DSV41_OLD_FIX='1': retired in pack 0.3.0")
    assert not runtime.decide(environ, names=()).refused
    # the same name without the table entry is a start-up error, as every unknown DSV41_ name
    monkeypatch.delitem(ledger.RETIRED_FLAGS, "DSV41_OLD_FIX")
    assert runtime.unknown_flags(environ) and runtime.decide(environ, names=()).refused
