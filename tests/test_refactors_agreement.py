"""The agreement table on the next release's ordinary refactors: doctor, doctor --engine, the
wrapper (the command read with the engine's own parser) and a rank (the ServerArgs its Scheduler
receives) give one verdict on every layout and flag combination, on one tree of each kind of
verdict tests/test_refactors.py finds (as 0.5.23, upstream's fix recognised, a site at the pack's
number, a subclass that drops the broadcast) and on the write pad renamed and moved.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib

import pytest

from harness import next_release, write_pad
from harness.engines import ROOT
from harness.ranks import run_ranks
from tests.agreement_cases import combos
from tests.test_refactors import OFF, R, S, SHAPES

pytestmark = pytest.mark.timeout(300)

SITE_PACKAGES = pathlib.Path(importlib.util.find_spec("sglang").origin).parent.parent
TABLE_TREES = ["moved-reexport", "decorator-wraps", "site-31", "subclass-drops-broadcast",  # a tree of each row of
               "write-pad-renamed", "write-pad-moved"]  # test_refactors.SHAPES' verdicts, and the write pad moved


def table_tree(name: str, into: pathlib.Path) -> pathlib.Path:
    if name.startswith("write-pad-"):
        return {"renamed": write_pad.renamed, "moved": write_pad.moved}[name.removeprefix("write-pad-")](SITE_PACKAGES, into)
    return next_release.tree(into, [name], SHAPES[name][0])


@pytest.mark.parametrize("name", sorted(TABLE_TREES))
def test_the_agreement_table_holds_on_each_kind_of_refactor(name, tmp_path):
    tree, model = next_release.proven_here(table_tree(name, tmp_path / name), combos()), tmp_path / "model"
    model.mkdir()
    layouts = run_ranks(1, "tests.agreement_cases:layouts", env={"PYTHONPATH": f"{tree}{os.pathsep}{ROOT}"}, warm=False,
                        kwargs={"model_dir": str(model), "source_tree": str(tree)}, timeout=280)[0]
    assert "tp4-dspark" in layouts and len(layouts) >= 4, sorted(layouts)
    for layout, found in layouts.items():
        assert len(found["rows"]) == len(combos())
        for env, row in zip(combos(), found["rows"]):
            assert row["doctor"] == row["sources"] == row["wrapper"] == row["rank"], (name, layout, env, row["reasons"])
            assert row["launch_refused"] == row["rank_refused"] == row["doctor_failed"], (name, layout, env)
    if name == "subclass-drops-broadcast":  # the table shows the refusal, not only agreement
        tp4 = layouts["tp4"]["rows"][combos().index({"DSV41_SPEC_TP_SYNC": "all"})]
        assert tp4["rank"]["rank0_broadcast"] == R and tp4["rank_refused"], tp4["reasons"]
    if name.startswith("write-pad"):  # the pad found by what it does: the engine guards itself
        guarded = [row["rank"]["known_bad_config"] for row in layouts["tp4-dspark"]["rows"]
                   if "known_bad_config" in row["rank"] and row["rank"]["known_bad_config"] != OFF]
        assert guarded and set(guarded) == {S}, guarded
