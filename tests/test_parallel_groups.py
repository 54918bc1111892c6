"""The runtime context's group handles the pack reads at run time (engine/parallel_groups.py):
shown on every release's sources and on the installed engine by the same layout, and
refused, with the symbol named, when a copy of the real sources reroutes them."""

from __future__ import annotations

import shutil

import pytest

from harness.doctored import doctored_module, DoctoredEngine
from harness.engines import release_sources
from sglang_dsv41_adapters import tp_divergence as t
from sglang_dsv41_adapters.engine import parallel_groups as groups
from sglang_dsv41_adapters.engine.contract import Refused
from sglang_dsv41_adapters.engine.installed import InstalledEngine
from sglang_dsv41_adapters.engine.source_engine import SourceEngine
from sglang_dsv41_adapters.framework import runtime

GETTERS, DERIVED = "return parallel_state's getters", "declared Derived on"
RELEASES = {"0.5.16": GETTERS, "0.5.18": GETTERS, "0.5.20": GETTERS, "0.5.21": DERIVED, "0.5.23": DERIVED}


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_shown_on_each_layout_from_the_sources(release):
    shown = groups.check("x", SourceEngine(release_sources(release), version=release))
    assert RELEASES[release] in shown and "tp_group and attn_tp_group" in shown


def test_the_installed_engine_is_judged_as_its_sources():
    """Installed, 0.5.23's ParallelContext carries the properties its import installed; they are
    judged by the declarations, as doctor --engine judges the sources."""
    from sglang.srt.runtime_context import ParallelContext

    assert isinstance(vars(ParallelContext)["tp_group"], property)
    assert groups.check("x", InstalledEngine()) == groups.check("x", SourceEngine(release_sources("0.5.23")))


def _tree(tmp_path, release, module, old, new):
    """A copy of a release's sources with one exact replacement in `module`."""
    tree = tmp_path / "engine"
    shutil.copytree(release_sources(release), tree)
    path = tree.joinpath(*module.split(".")).with_suffix(".py")
    text = path.read_text(encoding="utf-8")
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new), encoding="utf-8")
    return SourceEngine(tree, version=release)


@pytest.mark.parametrize("release,module,old,new,symbol", [
    ("0.5.23", groups.FIELDS, "    attn_tp_group = Derived(", "    attention_tp_group = Derived(",
     f"{groups.FIELDS}:Parallel.attn_tp_group"),
    ("0.5.23", groups.RUNTIME_CONTEXT, "        setattr(ParallelContext, name, property(getter))",
     "        setattr(ParallelContext, 'p_' + name, property(getter))", f"{groups.RUNTIME_CONTEXT}:{groups.INSTALLER}"),
    ("0.5.23", groups.RUNTIME_CONTEXT, "\n_install_parallel_properties()\n", "\n",
     f"{groups.RUNTIME_CONTEXT}:{groups.INSTALLER}"),
    ("0.5.23", groups.PARALLEL_STATE, '        "attn_tp_group": _ATTN_TP,\n', "",
     f"{groups.PARALLEL_STATE}:attn_tp_group"),
    ("0.5.18", groups.RUNTIME_CONTEXT, '        return self._v("tp_group", _ps().get_tp_group)',
     '        return self._v("tp_group", _ps().get_world_group)', f"{groups.RUNTIME_CONTEXT}:ParallelContext.tp_group"),
    ("0.5.18", groups.RUNTIME_CONTEXT, "    def attn_tp_group(self)", "    def attention_tp_group(self)",
     f"{groups.RUNTIME_CONTEXT}:ParallelContext.attn_tp_group"),
])
def test_refused_from_a_doctored_source_tree(tmp_path, release, module, old, new, symbol):
    engine = _tree(tmp_path, release, module, old, new)
    with pytest.raises(Refused) as refused:
        groups.check("x", engine)
    assert str(refused.value).startswith(f"x refused on sglang {release}: {symbol}: "), refused.value


def test_the_report_refuses_at_start_when_the_installed_context_drifts(clean_env, tmp_path):
    """Site 30 reads the groups at every compared step: a doctored copy of the real
    runtime_context that installs its properties under other names is refused by the
    report's plan, before anything is patched."""
    context = doctored_module(groups.RUNTIME_CONTEXT, ("        setattr(ParallelContext, name, property(getter))",
                                                       "        setattr(ParallelContext, 'p_' + name, property(getter))"),
                              directory=tmp_path)
    assert "tp_group" not in vars(context.ParallelContext)
    engine = DoctoredEngine({groups.RUNTIME_CONTEXT: context})
    outcome = runtime.decide({t.FLAG: "1"}, engine, names=(t.NAME,)).outcomes[0]
    assert outcome.state == runtime.REFUSED, outcome.reason
    assert f"{groups.RUNTIME_CONTEXT}:{groups.INSTALLER}" in outcome.reason and "sglang 0.5.23" in outcome.reason
