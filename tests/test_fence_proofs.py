"""The fence proven on the engine's own code: what it hands out is what the engine returned.

Each case changes the real sglang 0.5.23 source the way a reviewer might (a decorator, a
subclass, a field, a wider condition: tests/doctored.py loads the changed copy under the
real name), or changes the real objects at run time (an instance attribute, a class
attribute swapped after the cheap form was proven). The engine's own path runs on the CPU
twice on identical state: unfenced, and through the fence as the runtime applies it.
Every field of what the fence hands out equals what the engine returned (type, dtype,
shape, values; other fields as they were), in memory that no tensor of the epilogue
shares, and stays so when the next step rewrites the buffers; side effects happen as
often; the verdict (cheap form, general form and why, refused) and the fallback line are
what they should be. The boundary cases hand the check results of every shape.
"""

from __future__ import annotations

import cProfile
import functools
import gc
import importlib.util
import pathlib
import pstats
import shutil
import sys
import types

import pytest
import torch

from sglang_dsv41_adapters.folded_fence import fence_boundary, fence_forms, holders
from sglang_dsv41_adapters import folded_fence
from sglang_dsv41_adapters.framework import runtime
from sglang_dsv41_adapters.engine.source_engine import SourceEngine
from tests.conftest import Step, accept_kwargs, build_dspark
from harness.doctored import DoctoredEngine, doctored_module

V, W, UTILS = folded_fence.VERIFY, folded_fence.WORKER, "sglang.srt.managers.utils"
FIELDS = folded_fence.FIELDS
BS = 5
CALLS = fence_forms.PROOF_CALLS + 2  # the proofs, then the cheap form's own calls


@pytest.fixture(autouse=True)
def fresh(verify, monkeypatch):
    """Each test starts unpatched, with no line said yet."""
    fence_boundary.reset()
    yield
    runtime.revert()


def fence_on(engine=None) -> runtime.Decision:
    decision = runtime.decide({folded_fence.FLAG: "1"}, engine, names=(folded_fence.NAME,))
    runtime.apply(decision)
    return decision


def folded_form(decision):
    return next(p.wrapper for p in decision.plans[folded_fence.NAME].patches if p.where == "TargetVerifyExecutor.accept_and_finalize")


def epilogue_storages(epilogue) -> set:
    return {t.untyped_storage().data_ptr() for t in vars(epilogue).values() if isinstance(t, torch.Tensor) and t.numel()}


def kept(result):
    """The engine's result as it is now: its type and every field, tensors cloned."""
    return type(result), {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in holders.items(result)}


def assert_engines_values_in_fresh_memory(fenced, expected, epilogue) -> None:
    kind, fields = expected
    assert type(fenced) is kind
    mine = dict(holders.items(fenced))
    assert mine.keys() == fields.keys()
    for key, value in fields.items():
        got = mine[key]
        if isinstance(value, torch.Tensor):
            assert (type(got), got.dtype, got.shape) == (type(value), value.dtype, value.shape), key
            assert torch.equal(got, value), key
            assert got.untyped_storage().data_ptr() not in epilogue_storages(epilogue), f"{key} shares an epilogue buffer"
        else:
            assert got == value, key


class Effects:
    """Side effects the cheap form must reproduce or leave to the engine: note_static_verify's
    (the deferred commit's staged batch sizes, noted by Python code as the engine's own
    DeferredContextCommit does) and a doctored copy's own SEEN list."""

    def __init__(self, dspark):
        self.noted = []
        self.seen = getattr(dspark, "seen", None) or getattr(dspark.module, "SEEN", [])
        dspark.epilogue.deferred_commit = types.SimpleNamespace(note_static_verify=lambda bs: self.noted.append(bs))

    def take(self) -> tuple:
        found = (list(self.noted), list(self.seen))
        self.noted.clear()
        self.seen.clear()
        return found


def engine_then_fence(dspark, call, engine=None, calls: int = CALLS, decision=None):
    """`call()` through the engine's own path (fence off), then through the fence `calls`
    times, each on identical state (step N in the buffers, no side effect yet); each fenced
    result checked against the engine's, also after step N+1 rewrote the buffers. The fence
    as decided on `engine`, or `decision` applied again (a process decides once, at start)."""
    effects, step_n, step_next = Effects(dspark), Step(1, BS, dspark.stride), Step(2, BS, dspark.stride)
    step_n.write(dspark.epilogue)
    expected, expected_effects = kept(call()), effects.take()
    if decision is None:
        decision = fence_on(engine)
    else:
        runtime.apply(decision)
    for _ in range(calls):
        step_n.write(dspark.epilogue)
        fenced = call()
        assert effects.take() == expected_effects
        step_next.write(dspark.epilogue)
        assert_engines_values_in_fresh_memory(fenced, expected, dspark.epilogue)
    return decision, expected


def folded_call(dspark, executor=None, folded: bool = True):
    kwargs = accept_kwargs(dspark.module, bs=BS, stride=dspark.stride, folded=folded)
    return lambda: (executor or dspark.executor).accept_and_finalize(**kwargs)


def fallback_lines(capfd) -> list:
    return [line for line in capfd.readouterr().err.splitlines() if "cheap form off" in line]


# --- the cheap form where it is shown, on 0.5.23 -------------------------------------------

def test_cheap_form_hands_out_the_engines_values_and_is_trusted_after_its_proofs(dspark, capfd):
    decision, _ = engine_then_fence(dspark, folded_call(dspark))
    form = folded_form(decision)
    assert isinstance(form, fence_forms.CheapForm) and form.off is None
    assert form.trusted == {BS} and fallback_lines(capfd) == []
    # Trusted: the engine's path is not run any more (a wrapped that would raise is never called).
    outs = form(lambda **kw: pytest.fail("the engine's path ran"), dspark.executor, (), {"folded_accept": True, "bs": BS})
    assert type(outs) is dspark.module.AcceptOuts


def test_a_profiler_python_cannot_put_back_stays_on_and_what_it_profiles_proves_nothing(dspark, capfd):
    """cProfile on Python 3.11 holds the profile hook as an object that sys.setprofile cannot set
    again: the fence leaves it in place, hands out the engine's values, says so once and trusts
    nothing it did not see; once the profiler stops, the proofs are made as usual."""
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        held = sys.getprofile()
        decision, _ = engine_then_fence(dspark, folded_call(dspark))
        after = sys.getprofile()
    finally:
        profiler.disable()
    if held is None:
        pytest.skip("this Python's cProfile leaves the profile hook free (sys.monitoring): nothing to put back")
    assert after is held
    form = folded_form(decision)
    assert (form.off, form.trusted) == (None, set())
    lines = [line for line in capfd.readouterr().err.splitlines() if "cheap form" in line]
    assert len(lines) == 1 and "cheap form not proven while cProfile.Profile profiles this process" in lines[0], lines
    assert any("accept_and_finalize" in str(key) for key in pstats.Stats(profiler).stats)  # it saw the engine run
    engine_then_fence(dspark, folded_call(dspark), decision=decision)
    assert (form.off, form.trusted) == (None, {BS})


def test_the_cheap_form_builds_accept_outs_positionally_only_where_that_is_the_same_call(dspark):
    """0.5.23's AcceptOuts (a msgspec struct) takes its fields positionally, in order: the cheap
    form builds it so. A kw_only dataclass of the same fields, or fields in another order, is
    built by keyword."""
    import dataclasses

    fields = tuple(dspark.module.AcceptOuts.__struct_fields__)
    assert fence_forms.takes_positionally(dspark.module.AcceptOuts, fields)
    values = [object() for _ in fields]
    assert dspark.module.AcceptOuts(*values) == dspark.module.AcceptOuts(**dict(zip(fields, values)))
    keyword_only = dataclasses.make_dataclass("Outs", fields, kw_only=True)
    assert not fence_forms.takes_positionally(keyword_only, fields)
    assert not fence_forms.takes_positionally(dspark.module.AcceptOuts, fields[::-1])
    decision, _ = engine_then_fence(dspark, folded_call(dspark))
    form = folded_form(decision)
    assert form.positional and form.trusted == {BS}


def test_an_epilogue_subclass_that_changes_nothing_keeps_the_cheap_form(dspark):
    plain = type("PlainEpilogue", (dspark.module.DsparkVerifyEpilogue,), {})
    dspark.epilogue.__class__ = plain  # its class changes: proven again, and passes
    decision, _ = engine_then_fence(dspark, folded_call(dspark))
    assert folded_form(decision).context[2] is plain and folded_form(decision).off is None


# --- doctored copies of the real 0.5.23 dspark_verify: each a change a reviewer might make ---

HELPERS = (
    "import functools\n"
    "SEEN = []  # what this copy's side effects left\n\n\n"
    "def _swapped(method):  # changes values: bonus becomes a view of correct_len's buffer\n"
    "    @functools.wraps(method)\n"
    "    def wrapper(*args, **kwargs):\n"
    "        outs = method(*args, **kwargs)\n"
    "        outs.bonus = outs.correct_len\n"
    "        return outs\n"
    "    return wrapper\n\n\n"
    "def _counted(method):  # a side effect only\n"
    "    @functools.wraps(method)\n"
    "    def wrapper(*args, **kwargs):\n"
    "        SEEN.append(method.__name__)\n"
    "        return method(*args, **kwargs)\n"
    "    return wrapper\n\n\n"
)
STRUCT = "class AcceptOuts(msgspec.Struct):\n"
FIRST_CLASS = "class TargetVerifyExecutor:\n"
READ_DEF = "    def read_accept(self, bs: int) -> AcceptOuts:\n"
FOLDED_DEF = "    def accept_and_finalize(\n"
READ_BODY = "        return AcceptOuts(\n            correct_len=self.correct_len_buf[:bs],\n"


def doctored(tmp_path, *replacements, tail: str = ""):
    """The real dspark_verify with `replacements` (and HELPERS before its first class), and its engine."""
    module = doctored_module(V, (FIRST_CLASS, HELPERS + FIRST_CLASS), *replacements, tail=tail, directory=tmp_path)
    return module, DoctoredEngine({V: module})


SITE_PACKAGES = pathlib.Path(importlib.util.find_spec("sglang").origin).parent.parent


def doctored_sources(tmp_path, *replacements, tail: str = "") -> SourceEngine:
    """The same change in a copy of the installed release's sources (its .py files and its
    metadata), read as doctor --engine reads a release."""
    tree = tmp_path / "engine"
    shutil.copytree(SITE_PACKAGES / "sglang", tree / "sglang",
                    ignore=lambda folder, names: [n for n in names if not n.endswith(".py")
                                                  and not (pathlib.Path(folder) / n).is_dir()])
    shutil.copytree(next(SITE_PACKAGES.glob("sglang-*.dist-info")), tree / "sglang-0.5.23.dist-info")
    path = tree.joinpath(*V.split(".")).with_suffix(".py")
    text = path.read_text()
    for old, new in ((FIRST_CLASS, HELPERS + FIRST_CLASS), *replacements):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path.write_text(text + tail)
    return SourceEngine(tree)


def fence_outcome(engine) -> runtime.Outcome:
    return runtime.decide({folded_fence.FLAG: "1"}, engine, names=(folded_fence.NAME,)).outcomes[0]


GENERAL_CASES = {
    "read_accept decorated, values changed": (((READ_DEF, "    @_swapped\n" + READ_DEF),), "is decorated"),
    "read_accept decorated, a side effect only": (((READ_DEF, "    @_counted\n" + READ_DEF),), "is decorated"),
    "accept_and_finalize decorated, values changed": (((FOLDED_DEF, "    @_swapped\n" + FOLDED_DEF),), "is decorated"),
    "accept_and_finalize decorated, a side effect only": (((FOLDED_DEF, "    @_counted\n" + FOLDED_DEF),), "is decorated"),
    "read_accept returns a subclass of AcceptOuts with more fields": (
        ((READ_BODY, "        return SeenAcceptOuts(\n            seen=self.commit_lens_buf[:bs], note='seen',\n"
                     "            correct_len=self.correct_len_buf[:bs],\n"),),
        "read_accept is not one AcceptOuts("),
    "AcceptOuts runs a __post_init__": (
        ((STRUCT + "    correct_len:", STRUCT + "    def __post_init__(self):\n        SEEN.append('built')\n\n    correct_len:"),),
        "AcceptOuts runs code of its own"),
}
# AcceptOuts's fields moved to a base struct; `bonus` declared again in AcceptOuts keeps its place.
BASE_STRUCT = (
    (STRUCT, "class _AcceptFields(msgspec.Struct):\n"),
    ("    out_tokens: torch.Tensor\n\n\nclass StaticVerifyIO",
     "    out_tokens: torch.Tensor\n\n\nclass AcceptOuts(_AcceptFields):\n    bonus: torch.Tensor\n\n\nclass StaticVerifyIO"),
)
GENERAL_CASES["AcceptOuts inherits a __post_init__"] = (
    (BASE_STRUCT[0], (BASE_STRUCT[0][1] + "    correct_len:", BASE_STRUCT[0][1] + "    def __post_init__(self):\n"
                      "        SEEN.append('built')\n\n    correct_len:"), BASE_STRUCT[1]),
    "AcceptOuts runs code of its own")
SUBCLASS_TAIL = (
    "\n\nclass SeenAcceptOuts(AcceptOuts):\n"
    "    seen: Optional[torch.Tensor] = None\n"
    "    note: str = ''\n"
)


@pytest.mark.parametrize("name", sorted(GENERAL_CASES))
def test_a_changed_folded_path_takes_the_general_form_with_the_engines_values(name, tmp_path, capfd):
    replacements, why = GENERAL_CASES[name]
    module, engine = doctored(tmp_path, *replacements, tail=SUBCLASS_TAIL)
    dspark = build_dspark(module)
    decision, expected = engine_then_fence(dspark, folded_call(dspark), engine)
    assert folded_form(decision) is folded_fence.GENERAL_FOLDED
    assert f"general form on {folded_fence.FOLDED}: " in decision.outcomes[0].reason and why in decision.outcomes[0].reason
    if "more fields" in name:  # the extra fields came through: a view copied, a string as it was
        assert expected[1]["note"] == "seen" and torch.equal(expected[1]["seen"], Step(1, BS, 4).values["commit_lens"])
    assert fallback_lines(capfd) == []


def test_a_wider_folded_condition_is_fenced_by_what_the_engine_returned(tmp_path):
    """`if folded_accept or bs > 0`: the engine takes the folded branch with folded_accept=False;
    the fence copies the views it returned (the keyword did not say so)."""
    module, engine = doctored(tmp_path, ("        if folded_accept:\n", "        if folded_accept or bs > 0:\n"))
    dspark = build_dspark(module)
    decision, _ = engine_then_fence(dspark, folded_call(dspark, folded=False), engine)
    assert folded_form(decision) is folded_fence.GENERAL_FOLDED
    assert "the folded branch is not" in decision.outcomes[0].reason


def test_an_executor_subclass_overriding_accept_and_finalize_takes_the_general_form(tmp_path):
    tail = ("\n\nclass SwappingExecutor(TargetVerifyExecutor):\n"
            "    def accept_and_finalize(self, **kwargs):\n"
            "        outs = super().accept_and_finalize(**kwargs)\n"
            "        outs.bonus = outs.correct_len\n"
            "        return outs\n")
    module, engine = doctored(tmp_path, tail=tail)
    dspark = build_dspark(module)
    executor = object.__new__(module.SwappingExecutor)
    executor.verify_epilogue = dspark.epilogue
    decision, _ = engine_then_fence(dspark, folded_call(dspark, executor), engine)
    assert folded_form(decision) is folded_fence.GENERAL_FOLDED
    assert f"{V}:SwappingExecutor defines accept_and_finalize too" in decision.outcomes[0].reason


def test_read_accept_reading_another_buffer_is_replicated_as_it_reads(tmp_path):
    """bonus read from correct_len's buffer: the cheap form snapshots what read_accept reads."""
    module, engine = doctored(tmp_path, ("            bonus=self.bonus_buf[:bs],\n", "            bonus=self.correct_len_buf[:bs],\n"))
    dspark = build_dspark(module)
    decision, expected = engine_then_fence(dspark, folded_call(dspark), engine)
    assert isinstance(folded_form(decision), fence_forms.CheapForm) and folded_form(decision).trusted == {BS}
    assert torch.equal(expected[1]["bonus"], expected[1]["correct_len"])


def test_accept_outs_inheriting_its_fields_is_fenced_alike_imported_and_read_from_source(tmp_path):
    """msgspec gives AcceptOuts its base's fields; read from source, the base is found in the
    same module and its fields come first, as the engine's import has them."""
    module, engine = doctored(tmp_path, *BASE_STRUCT)
    assert module.AcceptOuts.__struct_fields__ == FIELDS and "correct_len" not in vars(module.AcceptOuts).get(
        "__annotations__", {})
    dspark = build_dspark(module)
    decision, _ = engine_then_fence(dspark, folded_call(dspark), engine)
    assert isinstance(folded_form(decision), fence_forms.CheapForm) and folded_form(decision).trusted == {BS}
    sources = doctored_sources(tmp_path, *BASE_STRUCT)
    assert sources.module(V).AcceptOuts.__struct_fields__ == FIELDS
    imported, read = decision.outcomes[0], fence_outcome(sources)
    assert (read.state, read.reason) == (imported.state, imported.reason) == (runtime.APPLIED, fence_outcome(None).reason)
    with_init = GENERAL_CASES["AcceptOuts inherits a __post_init__"][0]  # read alike: the general form
    read = fence_outcome(doctored_sources(tmp_path / "with-init", *with_init))
    assert read.reason == fence_outcome(doctored(tmp_path, *with_init)[1]).reason and "runs code of its own" in read.reason


PARTIAL_IN_BODY = ((READ_DEF, "    def _read_accept(self, bs: int) -> AcceptOuts:\n"),
                   ("    def read_block_accept_lens(",
                    "    read_accept = functools.partialmethod(_read_accept)\n\n    def read_block_accept_lens("))
REFUSED_CASES = {  # (replacements, tail, what the refusal names)
    "read_accept a property": (
        ((READ_DEF + "        return AcceptOuts(\n", "    @property\n    def read_accept(self):\n        return lambda bs: AcceptOuts(\n"),),
        "", "DsparkVerifyEpilogue.read_accept: is a property, not a plain function: its signature and source cannot "
            "be checked"),
    "read_accept a functools.partialmethod set on the class": (
        (), "\n\nDsparkVerifyEpilogue.read_accept = functools.partialmethod(DsparkVerifyEpilogue.read_accept)\n",
        "DsparkVerifyEpilogue.read_accept: is a functools.partialmethod, not a plain function: its signature and "
        "source cannot be checked"),
    "read_accept a functools.partialmethod in the class body": (
        PARTIAL_IN_BODY, "", "DsparkVerifyEpilogue.read_accept: is a functools.partialmethod, not a plain function"),
    "read_accept rebound in the class body": (
        (("    def read_block_accept_lens(", "    read_accept = _counted(read_accept)\n\n    def read_block_accept_lens("),),
        "", "refers to read_accept (bind)"),
    "an epilogue subclass overriding read_accept": (
        (), "\n\nclass ShiftedEpilogue(DsparkVerifyEpilogue):\n    def read_accept(self, bs):\n"
            "        return super().read_accept(bs + 1)\n", f"{V}:ShiftedEpilogue.read_accept: "),
}


@pytest.mark.parametrize("name", sorted(REFUSED_CASES))
def test_a_reader_the_checks_cannot_see_through_is_refused(name, tmp_path):
    replacements, tail, named = REFUSED_CASES[name]
    _, engine = doctored(tmp_path, *replacements, tail=tail)
    outcome = fence_outcome(engine)
    assert outcome.state == runtime.REFUSED
    assert named in outcome.reason, outcome.reason


@pytest.mark.parametrize("replacements,named", [
    (REFUSED_CASES["read_accept a property"][0], REFUSED_CASES["read_accept a property"][2]),
    (PARTIAL_IN_BODY, "DsparkVerifyEpilogue.read_accept: is bound to `functools.partialmethod(_read_accept)`, not a "
                      "plain function: its signature and source cannot be checked"),
])
def test_a_reader_that_is_no_plain_function_is_refused_for_that_when_read_from_source(replacements, named, tmp_path):
    outcome = fence_outcome(doctored_sources(tmp_path, *replacements))
    assert outcome.state == runtime.REFUSED and named in outcome.reason, outcome.reason


# --- the real 0.5.23 objects changed at run time, after the cheap form was proven ---------

def shadow_instance(dspark):
    """An instance attribute shadowing read_accept: bonus read from correct_len's buffer."""
    read = dspark.epilogue.read_accept

    def swapped(bs):
        outs = read(bs)
        outs.bonus = outs.correct_len
        return outs

    dspark.epilogue.read_accept = swapped
    return lambda: vars(dspark.epilogue).pop("read_accept")


def class_attribute(replacement):
    def swap(dspark):
        cls = type(dspark.epilogue)
        original = vars(cls)["read_accept"]
        setattr(cls, "read_accept", replacement(original, dspark))
        return lambda: setattr(cls, "read_accept", original)
    return swap


def decorated(original, dspark):
    seen = dspark.seen = []  # Effects compares it

    @functools.wraps(original)
    def wrapper(self, bs):
        seen.append("read_accept")
        return original(self, bs)
    return wrapper


def subclass_instance(dspark):
    """The executor's epilogue replaced by one of a subclass whose read_accept changes a field."""
    base = type(dspark.epilogue)

    def read_accept(self, bs):
        outs = base.read_accept(self, bs)
        outs.out_tokens = outs.out_tokens[:, :2]
        return outs

    dspark.epilogue.__class__ = type("NarrowEpilogue", (base,), {"read_accept": read_accept})
    return lambda: setattr(dspark.epilogue, "__class__", base)


def struct_rebound(dspark):
    """The module's AcceptOuts (which read_accept builds) rebound to a subclass with a field more."""
    module, original = dspark.module, dspark.module.AcceptOuts
    import msgspec

    module.AcceptOuts = msgspec.defstruct("WiderAcceptOuts", [("step", int, 7)], bases=(original,))
    return lambda: setattr(module, "AcceptOuts", original)


def epilogue_property(dspark):
    """The executor's class swapped for a subclass that reads verify_epilogue through a property."""
    base = type(dspark.executor)
    dspark.executor.__class__ = type("PropertyExecutor", (base,), {"verify_epilogue": property(lambda self: vars(self)["verify_epilogue"])})
    return lambda: setattr(dspark.executor, "__class__", base)


class Logged(torch.Tensor):
    """A tensor subclass with a Python hook on every operation, as tracing tools add."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


def subclass_buffer(dspark):
    original = dspark.epilogue.bonus_buf
    dspark.epilogue.bonus_buf = original.as_subclass(Logged)
    return lambda: setattr(dspark.epilogue, "bonus_buf", original)


RUNTIME_CASES = {
    "instance attribute shadowing read_accept": (shadow_instance, "read_accept is <function"),
    "read_accept swapped for a staticmethod": (
        class_attribute(lambda original, dspark: staticmethod(functools.partial(original, dspark.epilogue))),
        "read_accept is <staticmethod"),
    "read_accept swapped for a property": (
        class_attribute(lambda original, dspark: property(lambda self: functools.partial(original, self))),
        "read_accept is <property"),
    "read_accept decorated at run time": (class_attribute(decorated), "not the function checked"),
    "an epilogue of a subclass overriding read_accept": (subclass_instance, "NarrowEpilogue.read_accept is"),
    "AcceptOuts rebound to a wider struct": (struct_rebound, "read_accept returned a WiderAcceptOuts"),
    "verify_epilogue read through a property": (epilogue_property, "the engine's path runs epilogue_property.<locals>.<lambda>"),
    "a buffer of a tensor subclass": (subclass_buffer, "the engine's path runs Logged.__torch_function__"),
}


@pytest.mark.parametrize("name", sorted(RUNTIME_CASES))
def test_a_change_at_run_time_sends_the_process_to_the_general_form_once_and_loudly(name, dspark, capfd):
    change, why = RUNTIME_CASES[name]
    call = folded_call(dspark)
    decision, _ = engine_then_fence(dspark, call)  # proven and trusted
    form = folded_form(decision)
    assert form.trusted == {BS} and form.off is None
    runtime.revert()
    undo = change(dspark)
    try:  # the engine's own values with the change, then the fence's, as the process applied it
        engine_then_fence(dspark, call, decision=decision)
    finally:
        undo()
    assert form.off is not None and why in form.off, form.off
    assert len(fallback_lines(capfd)) == 1


# --- the general form's copy: every field of the returned object's own type ------------------

def returned_shapes(dspark, tmp_path) -> dict:
    """What a route may return, built from step N's views with the engine's own classes."""
    views = dspark.epilogue.read_accept(BS)
    frozen = dict(candidates=views.out_tokens, logits=views.correct_len, hidden=views.bonus, seq_lens=views.new_seq_lens,
                  req_pool_indices=views.commit_lens, out_cache_loc=views.cap_trim_lens, positions=views.bonus)
    return {
        "AcceptOuts (msgspec struct)": views,
        "StaticVerifyIO (frozen msgspec struct)": dspark.module.StaticVerifyIO(**frozen),
        "GenerationBatchResult (dataclass) with ints and None": generation_result(
            accept_lens=views.commit_lens, next_token_ids=views.out_tokens.reshape(-1), speculative_num_draft_tokens=4),
        "GenerationBatchResult (slotted dataclass)": slotted_result(tmp_path, views),
        "a tuple": (views.bonus, views.out_tokens, "tag"),
        "a dict": {"bonus": views.bonus, "seq": views.new_seq_lens, "n": BS},
    }


@pytest.mark.parametrize("shape", ["AcceptOuts (msgspec struct)", "StaticVerifyIO (frozen msgspec struct)",
                                   "GenerationBatchResult (dataclass) with ints and None",
                                   "GenerationBatchResult (slotted dataclass)", "a tuple", "a dict"])
def test_the_general_form_copies_every_field_of_what_was_returned(shape, dspark, tmp_path):
    Step(1, BS, dspark.stride).write(dspark.epilogue)
    result = returned_shapes(dspark, tmp_path)[shape]
    expected = kept(result)
    fenced = fence_forms.detach_shared(result, dspark.epilogue)
    Step(2, BS, dspark.stride).write(dspark.epilogue)
    assert_engines_values_in_fresh_memory(fenced, expected, dspark.epilogue)
    for key, value in holders.items(result):  # what is not a tensor is handed on as it was
        if not isinstance(value, torch.Tensor):
            assert dict(holders.items(fenced))[key] is value


# --- routes returning a view the keyword does not announce ------------------------------------

def block_accept_lens(dspark, worker_module, folded: bool):
    worker = object.__new__(worker_module.DSparkWorkerV2)
    worker._verify_epilogue = dspark.epilogue
    accept = dspark.module.AcceptOuts(**{f: torch.ones(BS, dtype=torch.int32) for f in FIELDS})
    return lambda: worker._block_accept_lens(accept=accept, folded_accept=folded, bs=BS)


@pytest.mark.parametrize("change", ["the reader returns the whole buffer", "the worker reads it whatever the keyword"])
def test_block_accept_lens_is_fenced_by_what_it_returns(change, tmp_path):
    from sglang.srt.speculative.dspark_components import dspark_verify as real_verify
    from sglang.srt.speculative.dspark_components import dspark_worker_v2 as real_worker

    if change == "the reader returns the whole buffer":
        module, engine = doctored(tmp_path, ("        return self.block_accept_lens_buf[:bs]\n", "        return self.block_accept_lens_buf\n"))
        worker_module, folded = real_worker, True
    else:
        worker_module = doctored_module(W, ("            if folded_accept and self._verify_epilogue is not None\n",
                                            "            if self._verify_epilogue is not None\n"), directory=tmp_path)
        module, engine, folded = real_verify, DoctoredEngine({W: worker_module}), False
    dspark = build_dspark(module)
    dspark.epilogue.block_accept_lens_buf = torch.arange(16, dtype=torch.int32) + 7  # the post-forward graph's buffer
    lens = block_accept_lens(dspark, worker_module, folded)
    step_n = lens().clone()
    assert lens().untyped_storage().data_ptr() == dspark.epilogue.block_accept_lens_buf.untyped_storage().data_ptr()
    fence_on(engine)
    fenced = lens()
    dspark.epilogue.block_accept_lens_buf.fill_(-1)
    assert torch.equal(fenced, step_n) and fenced.dtype == step_n.dtype
    assert fenced.untyped_storage().data_ptr() not in epilogue_storages(dspark.epilogue)


# --- the boundary: any shape of result, walked without raising --------------------------------

OPAQUE = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.CodeType,
          str, bytes, int, float)


def tensors_in(obj, skip, depth: int = 6) -> list:
    """Every tensor `obj` reaches through the objects it refers to (the garbage collector's
    view, not holders'), to `depth`, `skip` left out."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth == 0 or obj is skip or isinstance(obj, OPAQUE):
        return []
    return [t for ref in gc.get_referents(obj) for t in tensors_in(ref, skip, depth - 1)]


def leave_worker(dspark, build):
    """What a DSpark worker step built by `build(views)` from step N's accept views hands
    the scheduler, through the boundary check as the plan wraps forward_batch_generation;
    then step N+1 rewrites the buffers. Returns (what the worker returned, step N)."""
    from sglang.srt.speculative.dspark_components import dspark_worker_v2 as worker_module

    assert any(p.wrapper is fence_boundary.check_results for p in fence_on().plans[folded_fence.NAME].patches)
    worker = object.__new__(worker_module.DSparkWorkerV2)
    worker._verify_epilogue = dspark.epilogue
    step_n = Step(1, BS, dspark.stride)
    step_n.write(dspark.epilogue)
    result = fence_boundary.check_results(lambda self, batch: build(dspark.epilogue.read_accept(BS)), worker, (worker, None), {})
    Step(2, BS, dspark.stride).write(dspark.epilogue)
    shared = epilogue_storages(dspark.epilogue)
    assert [t for t in tensors_in(result, dspark.epilogue) if not t.is_sparse and t.untyped_storage().data_ptr() in shared] == []
    return result, step_n.values


def slotted_result(tmp_path, views):
    utils = doctored_module(UTILS, ("@dataclasses.dataclass\nclass GenerationBatchResult:\n",
                                    "@dataclasses.dataclass(slots=True)\nclass GenerationBatchResult:\n"), directory=tmp_path)
    return utils.GenerationBatchResult(next_token_ids=views.out_tokens.reshape(-1), accept_lens=views.commit_lens)


def generation_result(**fields):
    from sglang.srt.managers.utils import GenerationBatchResult

    return GenerationBatchResult(**fields)


def test_boundary_takes_a_slotted_dataclass_result(dspark, tmp_path, capfd):
    result, step_n = leave_worker(dspark, lambda views: slotted_result(tmp_path, views))
    assert type(result).__slots__ and result.accept_lens.tolist() == step_n["commit_lens"].tolist()
    assert torch.equal(result.next_token_ids, step_n["out_tokens"].reshape(-1))
    assert "GenerationBatchResult.accept_lens <- DsparkVerifyEpilogue.commit_lens_buf" in capfd.readouterr().err


def test_boundary_rebuilds_a_tuple_result_and_a_frozen_struct_in_it(dspark):
    """A tuple cannot take the copies: rebuilt, and the rebuilt one is what the worker returns;
    so is a frozen msgspec struct (the engine's own StaticVerifyIO) inside it."""
    def build(views):
        frozen = dspark.module.StaticVerifyIO(candidates=views.out_tokens, logits=views.correct_len, hidden=views.bonus,
                                              seq_lens=views.new_seq_lens, req_pool_indices=views.commit_lens,
                                              out_cache_loc=views.cap_trim_lens, positions=views.bonus)
        return generation_result(accept_lens=views.commit_lens), frozen, 3

    (result, frozen, three), step_n = leave_worker(dspark, build)
    assert type(frozen) is dspark.module.StaticVerifyIO and three == 3
    assert torch.equal(frozen.candidates, step_n["out_tokens"]) and torch.equal(frozen.seq_lens, step_n["new_seq_lens"])
    assert result.accept_lens.tolist() == step_n["commit_lens"].tolist()


def test_boundary_finds_views_in_lists_dicts_structs_and_two_levels_down(dspark, capfd):
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.model_executor.forward_batch_info import PPProxyTensors
    from sglang.srt.speculative.draft_worker_common import make_draft_input_v2

    def build(views):
        return generation_result(
            logits_output=LogitsProcessorOutput(next_token_logits=None, customized_info={"lens": [views.commit_lens]}),
            pp_hidden_states_proxy_tensors=PPProxyTensors({"bonus": views.bonus}),  # an object, a dict, a view
            next_draft_input=make_draft_input_v2(bonus_tokens=views.bonus, new_seq_lens=views.new_seq_lens),
            extra_keep_alive_refs=[views, {"out": views.out_tokens}, dspark.epilogue],  # a msgspec struct, a dict, the epilogue
        )

    result, step_n = leave_worker(dspark, build)
    assert result.pp_hidden_states_proxy_tensors["bonus"].tolist() == step_n["bonus"].tolist()
    assert result.logits_output.customized_info["lens"][0].tolist() == step_n["commit_lens"].tolist()
    assert torch.equal(result.next_draft_input.new_seq_lens, step_n["new_seq_lens"])
    struct, holder, epilogue = result.extra_keep_alive_refs
    assert type(struct) is dspark.module.AcceptOuts and torch.equal(struct.out_tokens, step_n["out_tokens"])
    assert torch.equal(holder["out"], step_n["out_tokens"])
    assert epilogue is dspark.epilogue and torch.equal(epilogue.commit_lens_buf[:BS], Step(2, BS, 4).values["commit_lens"])
    lines = [line for line in capfd.readouterr().err.splitlines() if "boundary:" in line]
    assert "GenerationBatchResult.pp_hidden_states_proxy_tensors.tensors['bonus'] <- DsparkVerifyEpilogue.bonus_buf" in "\n".join(lines)
    assert "GenerationBatchResult.extra_keep_alive_refs[].out_tokens <- DsparkVerifyEpilogue.out_tokens_buf" in "\n".join(lines)
    assert len(lines) == len(set(lines))


class Unreadable:
    """A holder whose fields cannot be read: every attribute lookup of its __dict__ raises."""

    @property
    def __dict__(self):
        raise RuntimeError("no fields to read")


def test_boundary_says_once_what_it_cannot_walk_or_reach_and_never_raises(dspark, capfd):
    deep = types.SimpleNamespace(a=types.SimpleNamespace(b=types.SimpleNamespace(c=types.SimpleNamespace(d=None))))

    def build(views):  # a sparse tensor (no storage to compare) before the view, in the same holder
        return generation_result(next_token_ids=torch.zeros(3).to_sparse(), accept_lens=views.commit_lens,
                                 dllm_algo_state=[Unreadable(), deep])

    for _ in range(3):
        result, step_n = leave_worker(dspark, build)
        assert result.accept_lens.tolist() == step_n["commit_lens"].tolist()
    err = capfd.readouterr().err
    assert err.count("could not walk GenerationBatchResult.dllm_algo_state[]") == 1
    assert err.count(f"lies deeper than {fence_boundary.MAX_DEPTH} levels") == 1


def test_boundary_stops_at_its_budget_after_the_results_own_fields(dspark, capfd):
    def build(views):  # the long list comes first in the result's fields
        return generation_result(dllm_algo_state=[torch.zeros(1)] * (fence_boundary.MAX_VALUES + 10),
                                 accept_lens=views.commit_lens)

    result, step_n = leave_worker(dspark, build)
    assert result.accept_lens.tolist() == step_n["commit_lens"].tolist()  # the shallow field first
    assert "boundary: stopped at GenerationBatchResult.dllm_algo_state" in capfd.readouterr().err


# --- sglang 0.5.18, whose folded branch has no note_static_verify: in a process of its own ---

@pytest.mark.parametrize("shadow", [False, True], ids=["as released", "read_accept shadowed at run time"])
def test_the_fence_hands_out_0_5_18s_own_values(shadow):
    from harness.ranks import run_ranks

    [result] = run_ranks(1, "tests.fence_proof_cases:folded_result_on_the_release", release="0.5.18",
                         kwargs={"shadow": shadow})
    assert result["version"] == "0.5.18" and result["form"] == "CheapForm" and result["notes"] is False
    assert result["calls"] == [{"type": True, "equal": True, "fresh": True}] * (fence_forms.PROOF_CALLS + 2)
    if shadow:
        assert result["trusted"] == [] and "DsparkVerifyEpilogue.read_accept is <function" in result["off"]
    else:
        assert result["trusted"] == [BS] and result["off"] is None
