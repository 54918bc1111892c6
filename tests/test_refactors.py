"""Ordinary refactors of the next release, judged by what runs: copies of the installed 0.5.23
with SpecTpSync renamed with an alias (by assignment, `import ... as`, a factory), moved and
re-exported, subclassed, its probe decorated (with and without functools.wraps) or delegated
to a staticmethod, and a site of the engine's own at a number the pack uses
(harness.next_release.REFACTORS), labelled 0.5.24 or 0.0.0.dev0.

Each tree is its own test case (its own timeout): judged from its sources (doctor --engine)
and imported (a child interpreter with the tree first on its path, as a rank), the two
verdicts equal, and the Dockerfile's own doctor command run on it. The whole agreement table
on one tree of each kind: tests/test_refactors_agreement.py.
"""

from __future__ import annotations

import os
import re
import shlex

import pytest

from harness import next_release, zygote
from harness.engines import ROOT, SETTINGS, python
from harness.ranks import run_ranks
from sglang_dsv41_adapters.engine.source_engine import SourceEngine
from sglang_dsv41_adapters.framework import runtime
from sglang_dsv41_adapters.framework.topology import Topology
from tests.next_release_cases import row as as_row
from tests.deployment_image import dockerfile_args, dockerfile_instructions

pytestmark = pytest.mark.timeout(300)

SYNC, MEM, REPORT = "rank0_broadcast", "group_min_memory", "tp_divergence"
S, A, R, OFF = runtime.SUPERSEDED, runtime.APPLIED, runtime.REFUSED, runtime.OFF
CASES = [({"DSV41_SPEC_TP_SYNC": "all"}, (4, 1)), ({"DSV41_GROUP_MIN_MEM": "1"}, (4, 1)),
         ({"DSV41_GROUP_MIN_MEM": "1"}, (4, 4)), ({"DSV41_SPEC_TP_SYNC": "all,pack-dflash-draft-greedy"}, (4, 1)),
         ({"DSV41_SPEC_TP_SYNC": "31"}, (4, 1)), ({"DSV41_TP_DIVERGENCE": "1"}, (4, 1))]
SAME_AS_0_5_23 = [S, S, A, A, A, A]  # what the release itself gives in these cases
RECOGNISED_FIX = [S, S, S, A, A, A]  # upstream's probe fix (#39954) in other words: superseded under DP attention too
# name: (label, the states of the adapter each case switches on, in CASES' order)
SHAPES = {
    "rename-alias": ("0.5.24", SAME_AS_0_5_23),
    "rename-import-as": ("0.0.0.dev0", SAME_AS_0_5_23),
    "rename-factory": ("0.5.24", SAME_AS_0_5_23),
    "moved-reexport": ("0.0.0.dev0", SAME_AS_0_5_23),
    "subclass-reexport": ("0.5.24", SAME_AS_0_5_23),
    "decorator-wraps": ("0.5.24", RECOGNISED_FIX),
    "decorator-plain": ("0.0.0.dev0", RECOGNISED_FIX),
    "probe-staticmethod": ("0.5.24", RECOGNISED_FIX),
    "site-31": ("0.5.24", [S, S, A, A, R, A]),  # only a selection that names 31 is ambiguous
    "site-30": ("0.0.0.dev0", SAME_AS_0_5_23),
    "subclass-drops-broadcast": ("0.5.24", [R, S, A, R, A, R]),  # what runs no longer broadcasts: refused
}
ADAPTER_OF = {"DSV41_SPEC_TP_SYNC": SYNC, "DSV41_GROUP_MIN_MEM": MEM, "DSV41_TP_DIVERGENCE": REPORT}


@pytest.fixture(params=sorted(SHAPES))
def shape(request, tmp_path):
    name = request.param
    return name, next_release.tree(tmp_path / name, [name], SHAPES[name][0])


def states(rows) -> list[str]:
    return [r["states"][ADAPTER_OF[next(iter(env))]] for (env, _), r in zip(CASES, rows)]


def test_each_refactor_is_judged_by_what_runs_alike_from_source_and_imported(shape):
    name, tree = shape
    engine = SourceEngine(tree)
    source = [as_row(runtime.decide(env, engine, topology=Topology(layout[0], attn_dp_size=layout[1])))
              for env, layout in CASES]
    imported = run_ranks(1, "tests.next_release_cases:decisions", env={"PYTHONPATH": f"{tree}{os.pathsep}{ROOT}"},
                         warm=False, kwargs={"cases": CASES}, timeout=280)[0]
    assert states(source) == SHAPES[name][1], [r["reasons"] for r in source]
    for (env, layout), a, b in zip(CASES, source, imported):
        assert a["states"] == b["states"] and a["env"] == b["env"] and a["patches"] == b["patches"], (env, layout, a, b)
    reasons = " ".join(r["reasons"][SYNC] for r in source if r["states"][SYNC] == S)
    built = {"rename-alias": "spec_tp_sync.SpecTpBroadcaster;", "rename-import-as": "worker_v2.TpBroadcast)",
             "rename-factory": "spec_tp_sync.make_tp_sync())", "moved-reexport": "worker_v2.MovedSync)",
             "subclass-reexport": "spec_tp_broadcast.SpecTpBroadcaster (what runs wrapped as its source says: "
                                  "SpecTpBroadcaster: SpecTpSync)"}.get(name)
    if built:  # the class the workers build named, and the names it is reached through where they are others
        assert "that class is the one the workers build" in reasons and built in reasons, reasons
    if name.startswith("decorator"):
        assert "@_over_configured" in reasons, reasons  # the wrapper named
    if name == "site-31":
        refused = source[4]["reasons"][SYNC]
        assert "SpecTpSyncSite.DFLASH_DRAFT_GREEDY" in refused and "pack-dflash-draft-greedy" in refused, refused
    if name == "subclass-drops-broadcast":
        assert "SpecTpBroadcaster.sync: broadcasts sites none" in source[0]["reasons"][SYNC]


def dockerfile_doctor() -> str:
    """The image build's doctor command, as the Dockerfile writes it."""
    (step,) = [args for instr, args in dockerfile_instructions() if instr == "RUN" and "sglang-adapters doctor" in args]
    return step[step.index("sglang-adapters doctor"):]


def tree_env(tree) -> dict:
    """This process's environment for a doctor run on `tree` (first on the path): no flag or engine
    switch of the test's, the pack's settings kept (the run's proof cache)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSV41_", "SGLANG_SPEC")) or k in SETTINGS}
    env["PYTHONPATH"] = f"{tree}{os.pathsep}{ROOT}"
    return env


def build_doctor(tree, required: str, tmp_path):
    """The Dockerfile's doctor command in the engine of `tree` (first on the path, as the
    image's Python imports its engine), REQUIRED_FLAGS=`required`, /opt/sglang-dsv41 a
    folder of the test's holding the recipe's adapters.env as the build's COPY puts it."""
    opt = tmp_path / "opt"
    opt.mkdir(exist_ok=True)
    (opt / "adapters.env").write_text((ROOT / "recipes/dsv41-flash-tp4-dspark/adapters.env").read_text())
    command = dockerfile_doctor().replace("/opt/sglang-dsv41", str(opt)).replace("sglang-adapters", "entrypoint.py", 1)
    env = {**tree_env(tree), "REQUIRED_FLAGS": required.replace("/opt/sglang-dsv41", str(opt))}
    done = zygote.run([python(), *shell_words(command, env)], cwd=ROOT, env=env, capture_output=True, text=True,
                      timeout=280, once=True)
    return done, opt / "doctor.json"


def shell_words(command: str, env: dict) -> list[str]:
    """The arguments the image's shell passes for `command`: its words, each "${NAME}" the
    variable's value (empty where unset), as one word. Only those forms are taken: anything else
    a shell would expand (an unquoted variable, which it would split) fails here."""
    assert command.count("$") == len(re.findall(r'"\$\{\w+\}"', command)), command
    words = shlex.split(command)
    assert not any(set(word) & set("`*?") for word in words), command
    return [re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), ""), word) for word in words]


def test_the_image_build_passes_on_each_refactor_with_no_flag_and_records_every_verdict(shape, tmp_path):
    name, tree = shape
    next_release.proven_here(tree, [{}])
    done, record = build_doctor(tree, "", tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.startswith("verdict: ok (exit 0)") and record.is_file()
    assert SHAPES[name][0] in record.read_text()  # the label it was judged under, kept


def test_the_image_build_fails_for_a_required_flag_the_pack_refuses(tmp_path):
    tree = next_release.proven_here(next_release.tree(tmp_path / "drops", ["subclass-drops-broadcast"], "0.5.24"), [{}])
    default = dockerfile_args()["REQUIRED_FLAGS"]
    assert default == "@/opt/sglang-dsv41/adapters.env"  # the recipe's flags, DSV41_SPEC_TP_SYNC=all among them
    done, record = build_doctor(tree, default, tmp_path)
    assert done.returncode == 69, done.stdout[-2000:] + done.stderr[-2000:]
    first = done.stdout.splitlines()[:3]
    assert first[0] == "verdict: refused (exit 69)" and any(
        line.startswith("  required and refused: rank0_broadcast DSV41_SPEC_TP_SYNC='all'") for line in first), first
    assert '"required"' in record.read_text()
    named, _ = build_doctor(tree, "DSV41_FOLDED_FENCE,DSV41_GROUP_MIN_MEM", tmp_path)  # flags it does not refuse
    assert named.returncode == 0, named.stdout[-2000:]
