"""The runtime binding audit (adapter.framework.audit) against the real engine: the fence applied on
0.5.23, and a doctored copy of a second real module that bound the original before the
pack applied, one holder kind each; rank0_broadcast on 0.5.18 with the issue's example."""

from __future__ import annotations

import sys
import types

import pytest

from sglang_dsv41_adapters.framework import audit, patching, runtime
from sglang_dsv41_adapters import folded_fence
from sglang_dsv41_adapters.framework.plan import Patch
from harness.doctored import doctored_module
from harness.ranks import run_ranks

SECOND = "sglang.srt.speculative.spec_utils"  # a real module the fence does not patch
WRAPPED = "sglang.srt.speculative.dspark_components.dspark_verify.TargetVerifyExecutor.accept_and_finalize"
IMPORT = ("\nimport functools as _functools\n"
          "from sglang.srt.speculative.dspark_components.dspark_verify import TargetVerifyExecutor as _Executor\n")

HOLDERS = {
    "global": ("finalize = _Executor.accept_and_finalize\n", f"{SECOND}.finalize"),
    "class attribute": ("class Copy:\n    finalize = _Executor.accept_and_finalize\n", f"{SECOND}.Copy.finalize"),
    "nested class attribute": ("class Outer:\n    class Inner:\n        finalize = _Executor.accept_and_finalize\n",
                               f"{SECOND}.Outer.Inner.finalize"),
    "staticmethod": ("class Static:\n    finalize = staticmethod(_Executor.accept_and_finalize)\n",
                     f"{SECOND}.Static.finalize"),
    "default argument": ("def later(finalize=_Executor.accept_and_finalize):\n    return finalize\n",
                         f"{SECOND}.later (default argument)"),
    "keyword-only default": ("def later(*, finalize=_Executor.accept_and_finalize):\n    return finalize\n",
                             f"{SECOND}.later (default of finalize)"),
    "method default": ("class Later:\n    def run(self, finalize=_Executor.accept_and_finalize):\n        return finalize\n",
                       f"{SECOND}.Later.run (default argument)"),
    "partial": ("finalize = _functools.partial(_Executor.accept_and_finalize, None)\n",
                f"{SECOND}.finalize (functools.partial)"),
    "partial class attribute": ("class Bound:\n    finalize = _functools.partial(_Executor.accept_and_finalize, None)\n",
                                f"{SECOND}.Bound.finalize (functools.partial)"),
    "table": ("ROUTES = {'folded': _Executor.accept_and_finalize}\n", f"{SECOND}.ROUTES (item)"),
}


@pytest.fixture
def fence():
    """The fence decided on the real 0.5.23; applied by the test, reverted after."""
    decision = runtime.decide({folded_fence.FLAG: "1"}, names=(folded_fence.NAME,))
    assert not decision.refused
    yield decision
    runtime.revert()


def engine_modules(*extra: types.ModuleType) -> dict:
    return {**sys.modules, **{m.__name__: m for m in extra}}


def test_the_real_engine_with_the_fence_applied_holds_no_original(fence):
    runtime.apply(fence)
    assert len(patching.applied()) == 4  # three routes and the boundary check
    assert audit.problems(patching.applied(), fence.engine) == []


@pytest.mark.parametrize("kind", sorted(HOLDERS))
def test_each_holder_of_the_original_is_refused_by_name(fence, tmp_path, kind):
    tail, holder = HOLDERS[kind]
    second = doctored_module(SECOND, tail=IMPORT + tail, directory=tmp_path)  # bound before the pack applies
    runtime.apply(fence)
    found = audit.problems(patching.applied(), fence.engine, engine_modules(second))
    assert found == [f"folded_fence refused on sglang 0.5.23: {holder} holds the original {WRAPPED} that folded_fence "
                     "wrapped: it was bound before the pack applied and would run unwrapped; switch DSV41_FOLDED_FENCE "
                     "off or use a release this pack supports"]


@pytest.mark.parametrize("kind", ["global", "partial", "default argument"])
def test_a_binding_made_after_the_pack_applied_holds_the_wrapper_and_passes(fence, tmp_path, kind):
    runtime.apply(fence)
    second = doctored_module(SECOND, tail=IMPORT + HOLDERS[kind][0], directory=tmp_path)
    assert audit.problems(patching.applied(), fence.engine, engine_modules(second)) == []


def test_a_wrapper_on_a_consumer_binding_is_audited_in_that_module_only(monkeypatch):
    """group_min_memory wraps only the probe modules' own binding of a shared helper:
    every other importer keeps the helper on purpose. Shown here on the scheduler's own
    binding of the engine's load_plugins, which other engine modules import too."""
    import sglang.srt.managers.scheduler as scheduler
    import sglang.srt.plugins as plugins

    original = scheduler.load_plugins
    assert original is plugins.load_plugins
    patching.apply(Patch(scheduler, "load_plugins", lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs)),
                   "group_min_memory")
    try:
        assert audit.problems(patching.applied(), "0.5.23") == []  # sglang.srt.plugins and others keep it
        monkeypatch.setattr(scheduler, "_loader_alias", original, raising=False)
        found = audit.problems(patching.applied(), "0.5.23")
        assert len(found) == 1
        assert "sglang.srt.managers.scheduler._loader_alias holds the original sglang.srt.managers.scheduler.load_plugins" \
               " that group_min_memory wrapped" in found[0]
    finally:
        patching.revert(scheduler, "load_plugins")


def test_a_0_5_18_worker_that_imports_the_wrapped_decision_by_name_is_refused():
    result = run_ranks(1, "tests.audit_cases:imported_by_name", release="0.5.18", timeout=400)[0]
    assert result["states"]["rank0_broadcast"] == "applied"
    assert result["clean"] == []
    assert result["found"] == [
        "rank0_broadcast refused on sglang 0.5.18: sglang.srt.speculative.dspark_components.dspark_worker_v2._accept holds "
        "the original sglang.srt.speculative.dspark_components.dspark_verify.accept_draft_tokens that rank0_broadcast "
        "wrapped: it was bound before the pack applied and would run unwrapped; switch DSV41_SPEC_TP_SYNC off or use a "
        "release this pack supports"]


def test_the_audit_runs_where_the_runtime_applies(fence, monkeypatch, tmp_path):
    """apply_once (launcher and every rank) refuses when the audit finds a holder."""
    second = doctored_module(SECOND, tail=IMPORT + HOLDERS["global"][0], directory=tmp_path)
    monkeypatch.setitem(sys.modules, SECOND, second)
    runtime.reset()
    decision = runtime.apply_once({folded_fence.FLAG: "1"})
    assert decision.refused
    assert f"{SECOND}.finalize holds the original {WRAPPED}" in decision.error().args[0]
