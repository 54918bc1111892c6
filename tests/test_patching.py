"""The pack's bindings on the real engine (0.5.23, the fence on): revert() unwinds only the pack's
own, leaving a wrapper another plugin put over it; and a fenced method pickles as the engine's does."""

from __future__ import annotations

import pickle

import pytest
import wrapt

from sglang_dsv41_adapters.framework import patching, runtime

FENCE = {"DSV41_FOLDED_FENCE": "1"}


@pytest.fixture
def fenced():
    import sglang.srt.speculative.dspark_components.dspark_verify  # noqa: F401 - the fence's class

    runtime.revert()
    decision = runtime.decide(FENCE)
    assert not decision.refused, decision.reasons
    runtime.apply(decision)
    saved = next(s for s in patching.applied() if s.name == "accept_and_finalize")
    yield saved
    runtime.revert()
    vars(saved.owner).get(saved.name) is saved.original or setattr(saved.owner, saved.name, saved.original)


def test_revert_leaves_a_later_wrapt_wrapper_and_unwinds_the_packs_beneath_it(fenced):
    owner, name = fenced.owner, fenced.name
    calls = []

    def later(wrapped, instance, args, kwargs):  # another plugin, after the pack
        calls.append(wrapped)
        return wrapped(*args, **kwargs)

    wrapt.wrap_function_wrapper(owner, name, later)
    theirs = vars(owner)[name]
    assert theirs.__wrapped__ is fenced.replacement
    runtime.revert()
    assert vars(owner)[name] is theirs  # the later plugin's wrapper stays where it was
    assert theirs.__wrapped__ is fenced.original  # the pack's own is gone from beneath it
    assert patching.applied() == []


def test_a_wrapper_that_cannot_be_rewired_keeps_both_and_says_so(fenced):
    """The engine's own HookRegistry wraps with a closure (functools.wraps): the pack's binding
    cannot be taken out from beneath it, so neither is removed and the binding stays recorded."""
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    owner, name = fenced.owner, fenced.name
    theirs = _wrap_fn(fenced.replacement, lambda original, *a, **k: original(*a, **k), HookType.AROUND)
    setattr(owner, name, theirs)
    assert patching.revert(owner, name) is False
    assert vars(owner)[name] is theirs and patching.original(owner, name) is fenced.original
    setattr(owner, name, fenced.replacement)  # as it was, for the fixture's own revert


def test_a_fenced_method_pickles_as_the_engines_does(fenced):
    owner, name = fenced.owner, fenced.name
    attribute = getattr(owner, name)
    assert isinstance(vars(owner)[name], wrapt.FunctionWrapper)
    assert pickle.loads(pickle.dumps(attribute)).__wrapped__ is fenced.original
    assert pickle.loads(pickle.dumps(vars(owner)[name])).__wrapped__ is fenced.original  # the class's own attribute
    runtime.revert()
    assert pickle.loads(pickle.dumps(getattr(owner, name))) is fenced.original
