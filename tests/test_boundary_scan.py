"""The boundary check's native scan (fence_boundary, the kernel file's `boundary_scan`) on the CPU.

The scan is host code in the fence's kernel library, so the real sm_80 file (conftest's
`sm80`, built once per session) loads and runs here. It may answer "clean" only where
fence_boundary's Python walk finds no route and says nothing; anything else is "unsure"
and the walk runs, copying and reporting as it always did. Each case is handed to both on
identical objects: the scan first (it changes nothing), then the walk, with no line said
yet. Where the case holds a view of an epilogue buffer, it must also come out copied on
that very call through check_results, the wrapper the plan puts on the worker's return.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import enum
import gc
import platform
import random
import sys
import types

import msgspec
import pytest
import torch

from sglang_dsv41_adapters.folded_fence import accept_snapshot, fence_boundary, holders, logits_readers
from bench.fence_host_cost import decode_result, dspark

pytestmark = pytest.mark.timeout(300)  # the first test may build the kernel file (conftest's sm80)
MAX_BS = 16


@pytest.fixture(scope="module")
def kernel(sm80):
    return accept_snapshot.load(str(sm80))[0]


@pytest.fixture
def epilogue(kernel):
    """A real 0.5.23 DsparkVerifyEpilogue on the CPU, the native scan serving the boundary check,
    every route copied (the logits' own route is left in place only where a test says so)."""
    fence_boundary.reset()
    logits_readers.decide(None)
    fence_boundary.use_native(kernel)
    yield dspark(MAX_BS)[1]
    fence_boundary.use_native()
    logits_readers.decide()
    fence_boundary.reset()


def verdicts(result, epilogue):
    """(the native scan's answer, the Python walk's routes, what the walk said), on the same objects.
    The answer is True (clean), False (unsure) or "shared": the scan named the tensors that share the
    epilogue's storages, and the routes the check names for them are the walk's (where no tuple holds one)."""
    clean = fence_boundary._cache(epilogue)[4](result, epilogue)
    named = None
    if isinstance(clean, list):
        try:
            named = {route for planned in fence_boundary.shared_routes(clean, epilogue) for route in planned[3]}
        except (TypeError, LookupError):  # a tuple holds one, or a holder reads otherwise: the check leaves it to the walk
            pass
        clean = "shared"
    fence_boundary._said.clear()
    _, routes = fence_boundary._walk(result, epilogue)
    assert named is None or named == set(routes), (named, routes)
    return clean, routes, set(fence_boundary._said)


def agree(build, epilogue, fresh_clean: bool = True) -> None:
    """`build(tensor)` makes a result holding `tensor` somewhere: with a fresh tensor the scan
    says clean (where `fresh_clean`) and the walk nothing; with a view of a buffer the walk finds
    it, and the scan is unsure or names exactly the tensors the walk copies, which the check then
    copies and says as the walk does. The walk meets the types first, as the first step would."""
    fence_boundary._walk(build(torch.zeros(3)), epilogue)  # holders.KINDS learns the types
    clean, routes, said = verdicts(build(torch.zeros(3)), epilogue)
    assert not clean or (routes, said) == ([], set()), (routes, said)
    assert clean is fresh_clean, (routes, said)
    view = epilogue.commit_lens_buf[:4]
    found, routes, said = verdicts(build(view), epilogue)
    assert found is not True and routes and all(r.endswith("<- DsparkVerifyEpilogue.commit_lens_buf") for r in routes)
    if found == "shared":
        result = build(view)
        found = fence_boundary._cache(epilogue)[4](result, epilogue)
        assert len(found) == len(shares(result, epilogue)) and all(t is view and path[0] is result for path, t, _ in found)
        fence_boundary._said.clear()
        checked = fence_boundary._checked(result, epilogue, found)
        assert shares(checked, epilogue) == [] and set(fence_boundary._said) == said


def through_worker(result, epilogue):
    """check_results as the plan wraps DSparkWorkerV2.forward_batch_generation."""
    worker = types.SimpleNamespace(_verify_epilogue=epilogue)
    return fence_boundary.check_results(lambda _worker, batch: result, worker, (worker, None), {})


def shares(result, epilogue, depth: int = 8) -> list:
    """The tensors `result` reaches that share the epilogue's storages (the test's own walk)."""
    storages = {t.untyped_storage().data_ptr() for t in vars(epilogue).values() if isinstance(t, torch.Tensor) and t.numel()}
    if isinstance(result, torch.Tensor):
        return [result] if result.untyped_storage().data_ptr() in storages else []
    if depth == 0 or result is epilogue or holders.kind(type(result)) == holders.LEAF:
        return []
    return [t for _, value in holders.items(result) if value is not None for t in shares(value, epilogue, depth - 1)]


# --- holders of every kind, nested ----------------------------------------------------------

class Slotted:
    __slots__ = ("a", "b")

    def __init__(self, a, b=None):
        self.a, self.b = a, b


class Struct(msgspec.Struct):
    a: object
    b: object = None


class Frozen(msgspec.Struct, frozen=True):
    a: object


@dataclasses.dataclass
class Data:
    a: object
    b: object = None


@dataclasses.dataclass
class DataSub(Data):  # a subclass adds a field: the value sits there
    extra: object = None


Pair = collections.namedtuple("Pair", "a b")

WRAP = {
    "list": lambda v: [1, None, v],
    "tuple": lambda v: ("x", v),
    "dict": lambda v: {"k": v, "none": None},
    "namedtuple": lambda v: Pair(2, v),
    "slotted": lambda v: Slotted(v),
    "struct": lambda v: Struct(v),
    "frozen_struct": lambda v: Frozen(v),
    "dataclass": lambda v: Data(v, b=3),
    "subclass_field": lambda v: DataSub(None, extra=v),
    "namespace": lambda v: types.SimpleNamespace(v=v, n=1.5),
}


def nested(kinds, value):
    for kind in reversed(kinds):
        value = WRAP[kind](value)
    return value


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", list(WRAP))
def test_a_view_at_each_depth_in_each_holder(epilogue, kind, depth):
    build = lambda v: nested([kind] * depth, v)  # noqa: E731
    agree(build, epilogue)
    result = through_worker(build(epilogue.commit_lens_buf[:4]), epilogue)  # caught and copied on this call
    assert shares(result, epilogue) == [] and type(result) is type(build(None))


@pytest.mark.parametrize("kinds", [["dict", "struct", "slotted", "list"], ["dataclass", "tuple", "namespace", "frozen_struct"],
                                   ["subclass_field", "namedtuple", "dict", "dataclass"]])
def test_a_view_four_holders_down_in_mixed_holders(epilogue, kinds):
    agree(lambda v: nested(kinds, v), epilogue)


def test_the_real_decode_result_is_clean_with_and_without_top_logprobs(epilogue):
    for logprobs in (False, True):  # bs 2: 2 x 8 top-logprob views, well within MAX_VALUES
        fence_boundary._walk(decode_result(2, logprobs), epilogue)
        result = decode_result(2, logprobs)
        assert verdicts(result, epilogue) == (True, [], set())
        for field in ("next_token_ids", "accept_lens"):  # a view planted in the result, then in what it holds
            result = decode_result(2, logprobs)
            setattr(result, field, epilogue.commit_lens_buf[:2])
            assert verdicts(result, epilogue)[:2] == ("shared", [f"GenerationBatchResult.{field} <- DsparkVerifyEpilogue.commit_lens_buf"])
        result = decode_result(2, logprobs)
        result.next_draft_input.bonus_tokens = epilogue.bonus_buf[:2]
        assert verdicts(result, epilogue)[:2] == ("shared", ["GenerationBatchResult.next_draft_input.bonus_tokens <- DsparkVerifyEpilogue.bonus_buf"])
        if logprobs:
            result = decode_result(2, logprobs)
            result.logits_output.next_token_top_logprobs_val[3] = epilogue.out_tokens_buf[1]
            assert verdicts(result, epilogue)[:2] == ("shared", ["GenerationBatchResult.logits_output.next_token_top_logprobs_val[] <- DsparkVerifyEpilogue.out_tokens_buf"])


def test_a_result_past_the_walks_budget_is_unsure(epilogue):
    """MAX_VALUES values are walked; one more and the walk stops and says so: so must the scan."""
    fresh = [torch.zeros(1) for _ in range(fence_boundary.MAX_VALUES + 1)]
    assert verdicts(fresh[:-1], epilogue) == (True, [], set())
    clean, routes, said = verdicts(fresh, epilogue)
    assert (clean, routes) == (False, []) and {key[0] for key in said} == {"cut"}
    leaves = [None, 1, "s"] * 300 + fresh[:-1]  # leaves and None are not counted
    assert verdicts(leaves, epilogue) == (True, [], set())
    result = decode_result(64, logprobs=True)  # 2 x 256 top-logprob views: past the budget
    fence_boundary._walk(decode_result(64, logprobs=True), epilogue)
    clean, routes, said = verdicts(result, epilogue)
    assert (clean, routes) == (False, []) and {key[0] for key in said} == {"cut"}


def test_a_holder_five_levels_down_is_unsure(epilogue):
    deep = nested(["namespace"] * 4, types.SimpleNamespace())  # an empty holder at level 5
    clean, routes, said = verdicts(deep, epilogue)
    assert (clean, routes) == (False, []) and {key[0] for key in said} == {"deep"}
    assert verdicts(nested(["namespace"] * 4, 7), epilogue) == (True, [], set())  # a leaf there: nothing to say
    clean, routes, said = verdicts(nested(["list"] * 5, epilogue.commit_lens_buf[:4]), epilogue)
    assert (clean, routes) == (False, []) and {key[0] for key in said} == {"deep"}  # out of the walk's reach: said


def test_a_type_not_met_yet_is_unsure_until_the_walk_has_met_it(epilogue):
    Fresh = type("Fresh", (), {})  # a new type: not in holders.KINDS
    result = Data(Fresh())
    result.a.t = torch.zeros(2)
    assert type(result.a) not in holders.KINDS
    assert verdicts(result, epilogue) == (False, [], set())  # the walk learns it, says nothing
    assert verdicts(result, epilogue) == (True, [], set())


def test_tensor_subclasses_are_left_to_the_walk_parameters_read(epilogue):
    class Marked(torch.Tensor):
        pass

    agree(lambda v: Data(v.as_subclass(Marked)), epilogue, fresh_clean=False)
    fresh, view = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(epilogue.bonus_buf[:2], requires_grad=False)
    fence_boundary._walk(Data(fresh), epilogue)  # the walk meets the type
    assert verdicts(Data(fresh), epilogue) == (True, [], set())
    assert verdicts(Data(view), epilogue)[:2] == ("shared", ["Data.a <- DsparkVerifyEpilogue.bonus_buf"])


class ListIter(list):
    def __iter__(self):  # reads otherwise than the scan would
        return iter([])


class PlainList(list):
    pass


class MyDict(dict):
    pass


def test_sequence_and_mapping_subclasses(epilogue):
    agree(lambda v: Data(PlainList([v])), epilogue)  # list's own iterator: read as a list
    agree(lambda v: Data(MyDict(k=v)), epilogue, fresh_clean=False)  # a dict subclass: the walk's
    fence_boundary._walk(Data(ListIter([torch.zeros(1)])), epilogue)
    # the walk reads what __iter__ gives (nothing): it finds no route, the scan is unsure
    assert verdicts(Data(ListIter([epilogue.commit_lens_buf])), epilogue) == (False, [], set())


class Raises(Slotted):
    __slots__ = ()

    def __init__(self):
        self.b = None

    @property
    def a(self):
        raise RuntimeError("not now")


class Unset(Slotted):
    __slots__ = ()

    def __init__(self, b):
        self.b = b  # `a` never set: getattr raises AttributeError, the walk skips it


class Unreadable:
    @property
    def __dict__(self):
        raise RuntimeError("no fields to read")


def test_a_getattr_that_raises_is_unsure_an_unset_slot_is_skipped(epilogue):
    for holder in (Raises(), Unreadable()):
        clean, routes, said = verdicts(Data(holder), epilogue)
        assert (clean, routes) == (False, []) and {key[0] for key in said} == {"walk"}
    agree(lambda v: Data(Unset(v)), epilogue)


def test_the_epilogue_and_storage_less_tensors(epilogue):
    fence_boundary._walk([epilogue, {"e": epilogue}], epilogue)  # the walk meets the types (the epilogue's is looked up before it is skipped)
    assert verdicts([epilogue, {"e": epilogue}], epilogue) == (True, [], set())  # skipped by both
    sparse = Data(torch.zeros(3).to_sparse())  # no storage: nothing to compare, the walk says nothing
    assert verdicts(sparse, epilogue) == (False, [], set())


def test_a_rebound_buffer_is_seen_on_the_step_it_appears(epilogue):
    """A buffer the epilogue allocates late or replaces: the scan's bound state is stale, so
    it is unsure, and the walk (rebuilding the map) copies a view of the new buffer."""
    agree(lambda v: Data(v), epilogue)
    epilogue._static_step_state = (4, object())  # per-step state: not watched, the scan still serves
    assert verdicts(Data(torch.zeros(2)), epilogue) == (True, [], set())
    epilogue.commit_lens_buf = torch.zeros_like(epilogue.commit_lens_buf)
    result = through_worker(Data(epilogue.commit_lens_buf[:3]), epilogue)
    assert shares(result, epilogue) == []
    assert verdicts(Data(torch.zeros(2)), epilogue) == (True, [], set())  # rebound: serving again
    epilogue.late_buf = torch.zeros(5)  # an attribute added
    assert fence_boundary._storages[id(epilogue)][4](Data(torch.zeros(1)), epilogue) is False
    assert shares(through_worker(Data(epilogue.late_buf[1:]), epilogue), epilogue) == []


def test_check_results_uses_the_scan_on_clean_steps_and_copies_a_planted_view_on_its_step(epilogue, monkeypatch):
    walks = []
    walk = fence_boundary._walk
    monkeypatch.setattr(fence_boundary, "_walk", lambda result, e: walks.append(result) or walk(result, e))
    through_worker(decode_result(4), epilogue)  # the first step: the walk meets the types, if no test did
    first = len(walks)
    for _ in range(3):
        result = decode_result(4)
        assert through_worker(result, epilogue) is result
    assert len(walks) == first, "the native scan did not serve the clean steps"
    planted = decode_result(4)
    planted.next_draft_input.new_seq_lens = epilogue.new_seq_lens_buf[:4]
    planted.accept_lens = epilogue.commit_lens_buf[:4]
    epilogue.new_seq_lens_buf[:4] = torch.arange(4)
    result = through_worker(planted, epilogue)  # the scan names the views: copied without the walk
    assert result is planted and len(walks) == first and shares(result, epilogue) == []
    epilogue.new_seq_lens_buf[:4] = 9  # the next step rewrites the buffers
    assert result.next_draft_input.new_seq_lens.tolist() == [0, 1, 2, 3]
    fence_boundary.use_native(None)  # the Python walk forced (benchmarks): every step walks
    through_worker(decode_result(4), epilogue)
    assert len(walks) == first + 1 and fence_boundary.check_mode() == "python"


class Worker:
    """A worker whose epilogue attribute may raise on reading, as a property can."""

    def __init__(self, epilogue, error=None):
        self._epilogue, self._error = epilogue, error

    @property
    def _verify_epilogue(self):
        if self._error is not None:
            raise self._error
        return self._epilogue


def both_forms(epilogue, call):
    """call(check_results) with the C form serving, then with the Python form: (value or the
    exception's type and text) for each."""
    outcomes = []
    through_worker(decode_result(4), epilogue)  # binds the scan, and with it the C form
    for native in (True, False):
        assert (fence_boundary._native_check is not None) is native
        try:
            outcomes.append(("value", call(fence_boundary.check_results)))
        except Exception as exc:  # noqa: BLE001 - compared between the forms
            outcomes.append((type(exc), str(exc)))
        fence_boundary._native_check, kept = None, fence_boundary._native_check
    fence_boundary._native_check = kept
    return outcomes


@pytest.mark.parametrize("case", ["kwargs", "no epilogue", "epilogue None", "result None", "result is the epilogue",
                                  "wrapped raises", "reading the epilogue raises", "no attribute"])
def test_the_c_form_of_check_results_answers_as_the_python_form(epilogue, case):
    result = decode_result(4)
    worker = {"no epilogue": Worker(None), "epilogue None": Worker(None),
              "reading the epilogue raises": Worker(epilogue, RuntimeError("epilogue gone")),
              "no attribute": types.SimpleNamespace()}.get(case, Worker(epilogue))
    returned = {"result None": None, "result is the epilogue": epilogue}.get(case, result)

    def step(_worker, batch, *, flag=None):
        if case == "wrapped raises":
            raise ValueError("step failed")
        assert flag == (1 if case == "kwargs" else None)
        return returned

    kwargs = {"flag": 1} if case == "kwargs" else {}
    outcomes = both_forms(epilogue, lambda check: check(step, worker, (worker, None), kwargs))
    assert outcomes[0] == outcomes[1]
    expected = {"wrapped raises": (ValueError, "step failed"),
                "reading the epilogue raises": (RuntimeError, "epilogue gone")}.get(case, ("value", returned))
    assert outcomes[0][0] == expected[0] and (outcomes[0][1] is returned if expected[0] == "value" else
                                              outcomes[0][1] == expected[1])


def checked_class(step):
    """A class whose forward_batch_generation is `step`, wrapped with check_results through the
    runtime's patching, as the plan wraps DSparkWorkerV2's."""
    from sglang_dsv41_adapters.framework import patching
    from sglang_dsv41_adapters.framework.plan import Patch

    cls = type("Worker", (Worker,), {"forward_batch_generation": step})
    patching.apply(Patch(cls, "forward_batch_generation", fence_boundary.check_results), "folded_fence")
    return cls


def test_the_class_holds_the_c_check_itself_once_a_scan_is_bound_and_wrapts_binding_without_it(epilogue):
    """Bound with wrapt until the scan serves, then as the kernel file's method (no wrapt hop, no
    Python frame of the pack's); recorded as the patch's replacement, looked through as the engine's
    own, reverted as before; wrapt's binding again when the Python walk is forced."""
    import inspect
    import wrapt
    from sglang_dsv41_adapters.framework import patching
    from sglang_dsv41_adapters.spectpsync import observation

    def forward_batch_generation(self, batch, *, flag=None):
        """The step."""
        return decode_result(4)

    cls = checked_class(forward_batch_generation)
    try:
        assert isinstance(vars(cls)["forward_batch_generation"], wrapt.FunctionWrapper)
        through_worker(decode_result(4), epilogue)  # binds the scan, and with it the class's method
        method = vars(cls)["forward_batch_generation"]
        assert not isinstance(method, wrapt.FunctionWrapper) and type(method).__name__ == "boundary_checked_method"
        assert method.__wrapped__ is forward_batch_generation and method.__code__ is forward_batch_generation.__code__
        assert (method.__name__, method.__qualname__, method.__doc__, method.__module__) == (
            "forward_batch_generation", forward_batch_generation.__qualname__, "The step.", __name__)
        assert inspect.signature(method) == inspect.signature(forward_batch_generation)
        assert cls.forward_batch_generation is method and cls(epilogue).forward_batch_generation.__self__ is not None
        assert [s.replacement for s in patching.applied() if s.owner is cls] == [method]
        assert observation.engine_defined(cls, "forward_batch_generation") is forward_batch_generation
        fence_boundary.use_native(None)
        assert isinstance(vars(cls)["forward_batch_generation"], wrapt.FunctionWrapper)
        assert observation.engine_defined(cls, "forward_batch_generation") is forward_batch_generation
    finally:
        patching.revert(cls, "forward_batch_generation")
    assert vars(cls)["forward_batch_generation"] is forward_batch_generation


def test_a_faster_binding_is_kept_by_the_wrappers_identity_and_leaves_what_something_else_replaced():
    """patching.bind_faster: a wrapper need not be hashable; the bindings made with it are re-made
    (those made later too), one that something else replaced since is left as it is, and without a
    faster form wrapt's binding comes back; reverting puts the original back either way."""
    import wrapt
    from sglang_dsv41_adapters.framework import patching
    from sglang_dsv41_adapters.framework.plan import Patch

    class Counting:  # an __eq__ and no __hash__: unhashable
        def __eq__(self, other):
            return self is other

        def __call__(self, wrapped, instance, args, kwargs):
            return "wrapt", wrapped(*args, **kwargs)

    def step(self, x):
        return x + 1

    wrapper = Counting()
    first, second, later = (type(name, (), {"step": step}) for name in ("First", "Second", "Later"))
    for cls in (first, second):
        patching.apply(Patch(cls, "step", wrapper), "bench")
    try:
        assert first().step(1) == ("wrapt", 2)
        second.step = lambda self, x: "replaced"  # something else bound it since
        patching.bind_faster(wrapper, patching.for_functions(lambda original: lambda self, x: ("faster", original(self, x))))
        assert first().step(1) == ("faster", 2) and first.step.__wrapped__ is step and first.step.__name__ == "step"
        assert second().step(1) == "replaced"
        patching.apply(Patch(later, "step", wrapper), "bench")  # made after: faster at once
        assert later().step(1) == ("faster", 2)
        patching.bind_faster(wrapper)
        assert isinstance(vars(first)["step"], wrapt.FunctionWrapper) and first().step(1) == ("wrapt", 2)
    finally:
        # revert leaves a binding something else made since (and keeps the pack's recorded): that one
        # gone first, as its owner would take it, so that nothing of this test stays recorded
        for saved in patching.applied():
            if saved.owner is second:
                setattr(second, "step", saved.replacement)
        for cls in (first, second, later):
            patching.revert(cls, "step")
    assert vars(first)["step"] is step and vars(later)["step"] is step and vars(second)["step"] is step
    assert not [saved for saved in patching.applied() if saved.adapter == "bench"]


@pytest.mark.parametrize("case", ["kwargs", "positional", "called on the class", "no epilogue", "epilogue None",
                                  "result None", "result is the epilogue", "wrapped raises",
                                  "reading the epilogue raises", "no instance", "escape"])
def test_the_c_method_answers_as_wrapts_binding_of_check_results(epilogue, case):
    """The same call through the class's C method and through wrapt's binding of the Python form:
    the same value (the very object, or a copy where a view of the epilogue leaves), the same error."""
    from sglang_dsv41_adapters.framework import patching

    result = decode_result(4)
    returned = {"result None": None, "result is the epilogue": epilogue}.get(case, result)
    seen = []

    def step(self, batch, *more, flag=None):
        seen.append((batch, more, flag))
        if case == "wrapped raises":
            raise ValueError("step failed")
        return returned

    cls = checked_class(step)
    holder = {"no epilogue": None, "epilogue None": None}.get(case, epilogue)
    worker = cls(holder, RuntimeError("epilogue gone") if case == "reading the epilogue raises" else None)
    call = {"kwargs": lambda: worker.forward_batch_generation(None, flag=1),
            "positional": lambda: worker.forward_batch_generation(None, 2, 3),
            "called on the class": lambda: cls.forward_batch_generation(worker, None),
            "no instance": lambda: cls.forward_batch_generation()}.get(case, lambda: worker.forward_batch_generation(None))
    outcomes = []
    try:
        through_worker(decode_result(4), epilogue)  # binds the scan: the class now holds the C method
        for native in (True, False):
            assert (type(vars(cls)["forward_batch_generation"]).__name__ == "boundary_checked_method") is native
            fence_boundary._said.clear()
            if case == "escape":  # planted again: the first form copied it in place
                result.accept_lens = epilogue.commit_lens_buf[:4]
            try:
                value = call()
                outcomes.append(("value", value is returned, shares(value, epilogue) if value is not None else []))
            except Exception as exc:  # noqa: BLE001 - compared between the forms
                outcomes.append((type(exc), str(exc).replace("step()", "")))
            outcomes.append(sorted(fence_boundary._said))
            fence_boundary.use_native(None)  # wrapt's binding of the Python walk
    finally:
        patching.revert(cls, "forward_batch_generation")
    assert outcomes[:2] == outcomes[2:], outcomes
    assert case == "no instance" or seen[0] == seen[-1] == {"kwargs": (None, (), 1),
                                                            "positional": (None, (2, 3), None)}.get(case, (None, (), None))
    expected = {"wrapped raises": ValueError, "reading the epilogue raises": RuntimeError, "no instance": TypeError}
    assert outcomes[0][0] is expected.get(case, "value") or outcomes[0][0] == expected.get(case, "value")
    if case == "escape":
        assert outcomes[0] == ("value", True, []) and outcomes[1], outcomes  # copied in place, its route said
    elif outcomes[0][0] == "value":
        assert outcomes[0][1] and outcomes[1] == []


def profiled(result, epilogue) -> tuple:
    """(through_worker's answer, the Python functions it called, in order)."""
    called = []
    sys.setprofile(lambda frame, event, arg: event == "call" and called.append(frame.f_code.co_name))
    try:
        return through_worker(result, epilogue), called
    finally:
        sys.setprofile(None)


def test_the_c_form_runs_no_python_of_the_packs_on_a_clean_step_and_copies_an_escape(epilogue):
    through_worker(decode_result(4), epilogue)
    assert fence_boundary._native_check is not None
    calls = lambda result: profiled(result, epilogue)  # noqa: E731

    result = decode_result(4)
    returned, called = calls(result)
    assert returned is result and called == ["through_worker", "check_results", "<lambda>"], called
    planted = decode_result(4)
    planted.accept_lens = epilogue.commit_lens_buf[:4]
    escaped, called = calls(planted)  # the scan names the view: copied and said without the walk
    assert {"_checked", "_copied"} <= set(called) and "_walk" not in called and shares(escaped, epilogue) == []
    planted = decode_result(4)
    planted.accept_lens = (epilogue.commit_lens_buf[:4],)  # a tuple cannot take a copy in place: the walk rebuilds it
    escaped, called = calls(planted)
    assert {"_checked", "_walk"} <= set(called) and shares(escaped, epilogue) == []


def test_random_shapes_agree(epilogue):
    """Random nests of every holder kind, leaves, None, fresh tensors and views."""
    rng = random.Random(7)
    views = [epilogue.commit_lens_buf[:2], epilogue.bonus_buf[1:], epilogue.out_tokens_buf[0]]

    def make(level, planted):
        if level > 6 or rng.random() < 0.3:
            return rng.choice([None, 3, "s", 2.5, torch.zeros(2), torch.ones(1, 2)] + (views if planted else []))
        return WRAP[rng.choice(list(WRAP))](make(level + 1, planted)) if rng.random() < 0.6 else \
            [make(level + 1, planted) for _ in range(rng.randint(0, 4))]

    seen = collections.Counter()
    for case in range(400):
        planted = case % 2 == 1
        state = rng.getstate()
        fence_boundary._walk(make(1, planted), epilogue)
        rng.setstate(state)
        result = make(1, planted)
        clean, routes, said = verdicts(result, epilogue)
        assert clean is not True or (routes, said) == ([], set()), (case, routes, said)
        assert clean != "shared" or routes, (case, said)
        seen[clean, bool(routes)] += 1
    assert seen[True, False] > 100 and seen["shared", True] > 15 and seen[False, True] > 5, seen  # each answer exercised


def first_steps_on_a_gpu():
    """A rank's first three decode steps through a fresh boundary check that asks for the native
    scan (the caller has made CUDA look up); the epilogue they ran on."""
    fence_boundary.reset()
    fence_boundary.use_native()
    epilogue = dspark(MAX_BS)[1]
    for _ in range(3):
        through_worker(decode_result(4), epilogue)
    return epilogue


def test_the_first_check_on_a_gpu_says_which_check_serves(sm80, monkeypatch, capsys):
    """What a rank does at its first step: CUDA is up, the kernel file is probed (the copy's
    line, if the fence's first CUDA result has not said it), the check says which serves and what
    it does with the graph's logits (logits_readers, from the installed engine's code)."""
    logits_readers.decide()
    monkeypatch.setenv(accept_snapshot.PATH_ENV, str(sm80))
    monkeypatch.setattr(accept_snapshot, "_mode", None)
    monkeypatch.setattr(accept_snapshot, "_kernel", None)
    monkeypatch.setattr(accept_snapshot, "_snapshot", None)
    monkeypatch.setattr(accept_snapshot, "_capability", lambda: (8, 0))  # this file serves an A100
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    try:
        first_steps_on_a_gpu()
        assert fence_boundary.check_mode() == "native"
        lines = [line for line in capsys.readouterr().err.splitlines() if "folded_fence" in line]
        assert len(lines) == 3 and lines[0].endswith(f"folded_fence copy: one-launch - {sm80}"), lines
        assert lines[1].endswith(f"folded_fence boundary check: native scan ({sm80})"), lines
        assert "folded_fence boundary: the graph's logits (logits_output.next_token_logits) are left in place after " \
               f"the first {logits_readers.WATCH_STEPS} steps with logits, watched: no code reads" in lines[2], lines
        monkeypatch.setenv(accept_snapshot.PATH_ENV, str(sm80.parent / "missing.so"))
        monkeypatch.setattr(accept_snapshot, "_mode", None)
        monkeypatch.setattr(accept_snapshot, "_kernel", None)
        fence_boundary.reset()
        fence_boundary.use_native()
        assert fence_boundary.check_mode() == "python"
        assert capsys.readouterr().err.splitlines()[-1].endswith(
            f"folded_fence boundary check: the Python walk (no kernel library: kernel not built ({sm80.parent / 'missing.so'} missing))")
    finally:
        fence_boundary.use_native()
        fence_boundary.reset()


def test_the_scans_self_checks_on_this_python(kernel):
    """What the self-checks find (bench/scan_pythons.sh runs this file on 3.11, 3.12 and 3.13): plain instances
    read by tp_traverse and the managed __dict__ word on each; dict versions that follow every change up to 3.12
    (on 3.13 an attribute stored through an instance leaves its made __dict__'s version as it was)."""
    assert kernel.layout() == {"plain_reads": True, "dict_versions": sys.version_info < (3, 13)}


def test_on_a_layout_the_scan_does_not_know_the_walk_serves_and_says_so_once(sm80, monkeypatch, capsys):
    """A Python whose layout the self-checks do not know (a later CPython, a free-threaded build): the
    first check on a GPU finds the kernel file, and the Python walk serves every step, said once."""
    kernel = accept_snapshot.load(str(sm80))[0]
    monkeypatch.setattr(kernel, "layout", lambda: {"plain_reads": False, "dict_versions": True})
    monkeypatch.setattr(accept_snapshot, "probed_extension", lambda: kernel)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    try:
        epilogue = first_steps_on_a_gpu()
        escaped = through_worker(Data(epilogue.commit_lens_buf[:2]), epilogue)
        assert fence_boundary.check_mode() == "python" and fence_boundary._cache(epilogue)[4] is None
        assert not shares(escaped, epilogue)  # the walk copied the view
        lines = [line for line in capsys.readouterr().err.splitlines() if "boundary check:" in line]
        assert len(lines) == 1 and lines[0].endswith(
            f"folded_fence boundary check: the Python walk (the native scan does not know how Python "
            f"{platform.python_version()} lays out an instance)"), lines
    finally:
        fence_boundary.use_native()
        fence_boundary.reset()


def test_on_the_cpu_the_walk_serves_and_nothing_is_said(capsys):
    fence_boundary.reset()
    fence_boundary.use_native()
    epilogue = dspark(MAX_BS)[1]
    result = Data(epilogue.commit_lens_buf[:2])
    assert fence_boundary.check_mode() == "python" and fence_boundary._cache(epilogue)[4] is None
    assert fence_boundary.detach_escapes(result, epilogue)[1] == ["Data.a <- DsparkVerifyEpilogue.commit_lens_buf"]
    assert "boundary check:" not in capsys.readouterr().err
    fence_boundary.reset()


def test_a_map_built_before_cuda_was_up_takes_the_scan_once_it_is(sm80, monkeypatch):
    monkeypatch.setenv(accept_snapshot.PATH_ENV, str(sm80))
    for name, value in (("_mode", None), ("_kernel", None), ("_snapshot", None), ("_capability", lambda: (8, 0))):
        monkeypatch.setattr(accept_snapshot, name, value)
    fence_boundary.reset()
    fence_boundary.use_native()
    try:
        epilogue = dspark(MAX_BS)[1]
        through_worker(decode_result(4), epilogue)  # CUDA not up yet: the walk, the scan not known
        assert fence_boundary._storages[id(epilogue)][4] is None
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        through_worker(decode_result(4), epilogue)
        assert fence_boundary._storages[id(epilogue)][4] is not None and fence_boundary.check_mode() == "native"
    finally:
        fence_boundary.use_native()
        fence_boundary.reset()


def test_a_slot_read_directly_follows_a_class_that_changes_after_the_scan_read_it(epilogue):
    """The scan reads struct fields and __slots__ straight from the instance while the type is as
    it was (its version tag): a field the class later hands to a property is read as getattr
    reads it, so a view the property returns is seen on the step it appears."""
    class Held(msgspec.Struct):
        a: object
        b: object = None

    class Kept:
        __slots__ = ("a",)

        def __init__(self, a):
            self.a = a

    for make in (lambda v: Held(v), lambda v: Kept(v)):
        holder = make(torch.zeros(2))
        fence_boundary._walk(Data(holder), epilogue)  # the walk meets the types
        assert verdicts(Data(holder), epilogue) == (True, [], set())  # read from the slot: clean
        cls = type(holder)
        view = epilogue.commit_lens_buf[:2]
        cls.a = property(lambda self: view)  # the class changes: its tag does
        try:
            clean, routes, _ = verdicts(Data(holder), epilogue)
            assert clean == "shared" and routes == ["Data.a.a <- DsparkVerifyEpilogue.commit_lens_buf"], routes
        finally:
            del cls.a


def test_an_epilogue_struct_whose_class_changes_is_walked_again(epilogue):
    """The epilogue's own memory read through a struct's slots: once the struct's class routes a
    field elsewhere, the map no longer holds (the scan is unsure), and the walk copies a view of
    what the field now reads."""
    from sglang.srt.speculative.dspark_components.dspark_verify import StaticVerifyIO

    class Served(StaticVerifyIO):
        pass

    ids = torch.zeros(8, dtype=torch.int64)
    epilogue.static_io[4] = Served(candidates=ids[:4].view(1, 4), logits=torch.zeros(4, 2), hidden=torch.zeros(4, 2),
                                   seq_lens=ids[4:5], req_pool_indices=ids[4:5], out_cache_loc=ids[:4], positions=ids[:4])
    result = Data(torch.zeros(2))
    fence_boundary._walk(result, epilogue)
    assert verdicts(result, epilogue) == (True, [], set())
    assert verdicts(result, epilogue) == (True, [], set())  # the struct's slots now compared in place
    replaced = torch.zeros(2, dtype=torch.int64)
    msgspec.structs.force_setattr(epilogue.static_io[4], "positions", replaced)  # a field rebound: the map no longer holds
    view = replaced[:1]
    found = fence_boundary._cache(epilogue)[4](Data(view), epilogue)  # mapped again: the new field's view is named
    assert len(found) == 1 and found[0][1] is view
    assert fence_boundary._walk(Data(replaced[:1]), epilogue)[1] == ["Data.a <- DsparkVerifyEpilogue.static_io[4].positions"]
    moved = torch.zeros(3, dtype=torch.int64)
    Served.seq_lens = property(lambda self: moved)  # the field now reads other memory
    try:
        view = moved[:2]
        found = fence_boundary._cache(epilogue)[4](Data(view), epilogue)  # mapped again: what the field reads now
        assert len(found) == 1 and found[0][1] is view
        _, routes = fence_boundary._walk(Data(moved[:2]), epilogue)
        assert routes == ["Data.a <- DsparkVerifyEpilogue.static_io[4].seq_lens"], routes
    finally:
        del Served.seq_lens


# --- the compiled freshness test ---------------------------------------------------------------

def _slot_deleted(epilogue, holder):
    del holder.a
    return None  # nothing new to hand out: the map only has to be read again


def _free_slot_takes_a_view(epilogue, holder):
    holder.b = epilogue.static_io[4].seq_lens[:1]  # where an int was (a free slot of the map)
    return holder.b, "extra.b"


def _struct_replaced(epilogue, holder):
    from sglang.srt.speculative.dspark_components.dspark_verify import StaticVerifyIO

    old, fresh = epilogue.static_io[4], torch.zeros(4, dtype=torch.int64)
    epilogue.static_io[4] = StaticVerifyIO(**{**msgspec.structs.asdict(old), "seq_lens": fresh})
    return fresh[:2], "static_io[4].seq_lens"


def _field_rebound(epilogue, holder):
    fresh = torch.zeros(4, dtype=torch.int64)
    msgspec.structs.force_setattr(epilogue.static_io[8], "seq_lens", fresh)
    return fresh[:2], "static_io[8].seq_lens"


def _class_changed(epilogue, holder):
    fresh = torch.zeros(4, dtype=torch.int64)
    holder.__class__ = type("Rerouted", (Slotted,), {"__slots__": (), "a": property(lambda self: fresh)})
    return fresh[:2], "extra.a"


def _set_(epilogue, holder):
    fresh = torch.zeros(64, dtype=torch.int64)
    epilogue.static_io[8].positions.set_(fresh)
    return fresh[:2], "static_io[8].positions"


def _data(epilogue, holder):
    fresh = torch.zeros(16, dtype=torch.int64)
    epilogue.static_io[2].seq_lens.data = fresh
    return fresh[:2], "static_io[2].seq_lens"


def _swapped(epilogue, holder):
    target = epilogue.static_io[4].positions
    torch.utils.swap_tensors(target, torch.zeros_like(target))
    return target[:2], "static_io[4].positions"


def _resized(epilogue, holder):
    base = epilogue.static_io[16].hidden
    base.resize_(base.shape[0] * 64, base.shape[1])  # the storage every size shares grows: its memory moves
    return base[:1], "static_io[1].hidden"  # the first holder of that storage the walk meets


def _stored_in_vars(epilogue, holder):
    fresh = torch.zeros(8, dtype=torch.int32)
    vars(epilogue)["commit_lens_buf"] = fresh  # straight into the instance's __dict__
    return fresh[:2], "commit_lens_buf"


def _vars_replaced(epilogue, holder):
    fresh = torch.zeros(8, dtype=torch.int32)
    epilogue.__dict__ = {**vars(epilogue), "commit_lens_buf": fresh}  # another dict, equal but for one value
    return fresh[:2], "commit_lens_buf"


def _buffer_registered(epilogue, holder):
    fresh = torch.zeros(4)
    epilogue.commit_ctx.draft_model.register_buffer("late", fresh)  # an OrderedDict of the module's
    return fresh[:2], "commit_ctx.draft_model._buffers['late']"


def _static_io_updated(epilogue, holder):
    from sglang.srt.speculative.dspark_components.dspark_verify import StaticVerifyIO

    fresh = torch.zeros(4, dtype=torch.int64)
    dict.update(epilogue.static_io, {3: StaticVerifyIO(**{**msgspec.structs.asdict(epilogue.static_io[2]), "seq_lens": fresh})})
    return fresh[:2], "static_io[3].seq_lens"


class _Loose:  # a plain class an enum member can be given (the same layout): a holder, not a leaf
    pass


def _free_value_turns_holder(epilogue, holder):
    fresh = torch.zeros(4)
    epilogue.mode.__class__ = _Loose  # the same object in the epilogue's __dict__, its version unchanged
    vars(epilogue.mode)["payload"] = fresh
    return fresh[:2], "mode.payload"


COMPILED_CHANGES = {f.__name__.strip("_"): f for f in (
    _free_value_turns_holder,
    _slot_deleted, _free_slot_takes_a_view, _struct_replaced, _field_rebound, _class_changed, _set_, _data, _swapped,
    _resized, _stored_in_vars, _vars_replaced, _buffer_registered, _static_io_updated)}


@pytest.mark.parametrize("change", list(COMPILED_CHANGES))
def test_the_compiled_freshness_test_sees_each_change_on_the_step_it_appears(epilogue, change):
    """After a full pass holds, the scan tests the map as flat reads: slots of structs and slotted
    holders against the objects the map found, dicts and __dict__s by their versions, each tensor's
    impl, storage and data. Each change made after it serves makes it unsure on that very step, and
    the walk finds what the change brought in: a slot unset, a free slot taking a view, a struct
    replaced in static_io or one added by dict.update, a field rebound, a slotted holder's class
    changed, a tensor set_, .data =, swapped or resized, a value stored straight into the
    epilogue's __dict__ or the __dict__ replaced, a buffer registered on the draft model, a leaf of
    the epilogue's __dict__ given a class that makes it a holder (no dict's version changes)."""
    from bench.fence_host_cost import captured

    captured(epilogue)  # static_io for every captured size up to MAX_BS, a commit context
    holder = Slotted(torch.zeros(3), 7)
    epilogue.extra = holder
    epilogue.mode = enum.Enum("Mode", "ON").ON  # a leaf: a free slot of the map
    result = Data(torch.zeros(2))
    fence_boundary._walk(result, epilogue)
    for _ in range(3):  # the first full pass compiles; the next ones are the compiled form's
        assert verdicts(result, epilogue) == (True, [], set())
    scan = fence_boundary._storages[id(epilogue)][4]
    planted = COMPILED_CHANGES[change](epilogue, holder)
    if planted is None:
        assert scan(result, epilogue) is False
        assert verdicts(result, epilogue) == (True, [], set())  # mapped again: serving again
        return
    view, route = planted
    assert scan(Data(view), epilogue) is False
    assert fence_boundary._walk(Data(view), epilogue)[1] == [f"Data.a <- DsparkVerifyEpilogue.{route}"]
    handed = through_worker(Data(view), epilogue).a  # through check_results, as the worker's return
    assert torch.equal(handed, view) and handed.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()


# --- a plain instance read without making its __dict__ ------------------------------------------

def _dict_made(obj) -> bool:
    """Whether CPython made obj's __dict__. Up to 3.12 the collector then visits that dict, not the values; from
    3.13 it visits the values either way, so there the managed-dict word before the object's header is read."""
    if sys.version_info < (3, 13):
        return any(type(r) is dict for r in gc.get_referents(obj))
    return ctypes.c_void_p.from_address(id(obj) - 3 * ctypes.sizeof(ctypes.c_void_p)).value is not None


def test_a_new_result_is_read_without_making_its_dict_and_a_view_in_it_is_caught(epilogue):
    """A dataclass built anew each step: the scan reads its attributes as the collector does,
    making no __dict__ (a cost per object, at each step), and still sees a view in it."""
    fence_boundary._walk(Data(torch.zeros(2), b=Data(1)), epilogue)  # the walk meets the types
    result = Data(torch.zeros(2), b=Data(torch.zeros(1)))
    assert fence_boundary._cache(epilogue)[4](result, epilogue) is True
    assert not _dict_made(result) and not _dict_made(result.b)
    view = epilogue.commit_lens_buf[:2]
    for planted in (Data(view), Data(None, b=Data(view))):
        found = fence_boundary._cache(epilogue)[4](planted, epilogue)
        assert len(found) == 1 and found[0][1] is view and found[0][0][0] is planted and not _dict_made(planted)
        handed = through_worker(planted, epilogue)
        assert shares(handed, epilogue) == []
    result = Data(torch.zeros(2))
    vars(result)  # made by a reader: read as a dict, the same answer
    assert _dict_made(result) and fence_boundary._cache(epilogue)[4](result, epilogue) is True


class ShownDict:
    """An instance whose __dict__ attribute shows other than what it holds: vars() reads that."""
    shown: dict = {}

    @property
    def __dict__(self):
        return type(self).shown


class GetattributeDict:
    shown: dict = {}

    def __getattribute__(self, name):
        return type(self).shown if name == "__dict__" else object.__getattribute__(self, name)


@pytest.mark.parametrize("cls", [ShownDict, GetattributeDict])
def test_an_instance_whose_dict_reads_otherwise_is_read_through_vars(epilogue, cls):
    """What the walk reads is vars(h): where a class shows a __dict__ of its own making, the scan
    reads that too (not the values the instance holds), and is unsure where it shows a view."""
    holder = cls()
    object.__setattr__(holder, "kept", torch.zeros(2))
    cls.shown = {"v": torch.zeros(2)}
    fence_boundary._walk(Data(holder), epilogue)
    assert verdicts(Data(holder), epilogue) == (True, [], set())
    object.__setattr__(holder, "kept", epilogue.commit_lens_buf[:2])  # held, not shown: neither reads it
    assert verdicts(Data(holder), epilogue) == (True, [], set())
    cls.shown = {"v": epilogue.commit_lens_buf[:2]}  # shown: both see it
    clean, routes, _ = verdicts(Data(holder), epilogue)
    assert clean == "shared" and routes == ["Data.a.v <- DsparkVerifyEpilogue.commit_lens_buf"], routes


@pytest.mark.parametrize("meddle", ["none", "store", "delete"])
def test_a_plain_instance_changed_while_it_is_read_is_unsure(epilogue, meddle):
    """The values of a plain instance are read once, then judged one by one; a judgment that runs
    Python (a property) may store into or delete from that instance meanwhile. The scan then
    reads it again and is unsure where it changed, never using a value it no longer holds."""
    box = []

    def meddling(self):
        outer = box[0]
        if meddle == "store":
            outer.late = epilogue.commit_lens_buf[:2]
        elif meddle == "delete":
            try:
                del outer.b  # the only holder of its list (vars() would make the __dict__)
            except AttributeError:
                pass
        return None

    Meddling = type("Meddling", (), {"__slots__": (), "field": property(meddling)})
    holders._layouts[Meddling] = (("field",), False)  # a holder read by getattr: the property runs
    box.append(Data(1, b=[2]))
    fence_boundary._walk(Data(Meddling(), b=[torch.zeros(1)]), epilogue)  # the walk meets the types
    outer = Data(Meddling(), b=[torch.zeros(1)])
    box[0] = outer
    assert not _dict_made(outer) and type(outer.a) in holders.KINDS
    assert fence_boundary._cache(epilogue)[4](outer, epilogue) is (meddle == "none")  # read alike, then changed
    if meddle == "store":
        routes = fence_boundary._walk(outer, epilogue)[1]
        assert routes == ["Data.late <- DsparkVerifyEpilogue.commit_lens_buf"], routes
    elif meddle == "delete":
        assert "b" not in vars(outer)


def test_the_c_form_follows_each_epilogue_it_is_handed(epilogue):
    """The C check keeps the last epilogue's scan while the map is unchanged: handed another
    epilogue, or the same one mapped again, it answers for that one."""
    other = dspark(MAX_BS)[1]
    through_worker(Data(torch.zeros(1)), epilogue)  # maps it and binds the C check
    assert fence_boundary._native_check is not None
    for step in range(3):
        for mine, theirs in ((epilogue, other), (other, epilogue)):
            clean = Data(torch.zeros(1))
            assert through_worker(clean, mine) is clean
            foreign = Data(theirs.commit_lens_buf[:2])  # the other epilogue's memory: not this one's
            assert through_worker(foreign, mine).a is foreign.a
            handed = through_worker(Data(mine.commit_lens_buf[:2]), mine)
            assert shares(handed, mine) == [], (step, mine is epilogue)
        epilogue.commit_lens_buf = torch.zeros_like(epilogue.commit_lens_buf)  # mapped again at its next check


def test_logits_the_graph_returns_are_copied_as_static_io_holds_them(epilogue):
    """0.5.23's decode graph returns its logits as a slice of the output that static_io[bs].logits
    holds since capture: the scan names them, and the check copies them at each step without the
    walk and names the route once (a cost that buys nothing on 0.5.23's serving path:
    docs/performance.md, "The served step")."""
    from bench.fence_host_cost import captured, rebuilt

    captured(epilogue)
    result = decode_result(8)
    graph_logits = epilogue.static_io[8].logits
    served = rebuilt(result, logits=graph_logits[:8 * 4])
    found = fence_boundary._cache(epilogue)[4](served, epilogue)
    assert [(path[1:], tensor) for path, tensor, _ in found] == [((served.logits_output,), served.logits_output.next_token_logits)]
    handed = through_worker(served, epilogue).logits_output.next_token_logits
    assert torch.equal(handed, graph_logits[:32])
    assert handed.untyped_storage().data_ptr() != graph_logits.untyped_storage().data_ptr()
    assert through_worker(rebuilt(result), epilogue).logits_output.next_token_logits is result.logits_output.next_token_logits


def test_the_keys_kept_by_type_are_read_again_at_each_step(epilogue):
    """The check keeps the keys it found shared tensors under by the types down their path; a later
    result of those same types that keeps them elsewhere (another field, index or count) is read
    again: the routes named are the walk's, and every view leaves copied."""
    view = epilogue.commit_lens_buf[:2]
    builds = [lambda: Data(view), lambda: Data(None, b=view), lambda: Data(view, b=view),
              lambda: Data([torch.zeros(1), view]), lambda: Data([view, torch.zeros(1)]), lambda: Data([view, view]),
              lambda: Data(Data(view)), lambda: Data(None, b=Data(view)), lambda: Data(Data(None, b=view))]
    for build in builds:
        fence_boundary._walk(build(), epilogue)  # the walk meets the types
    for build in builds * 2:  # each after another of the same types
        found, routes, _ = verdicts(build(), epilogue)  # verdicts: the routes named are the walk's
        assert found == "shared" and routes
        result = build()
        checked = fence_boundary._checked(result, epilogue, fence_boundary._cache(epilogue)[4](result, epilogue))
        assert checked is result and shares(result, epilogue) == []
    assert len(fence_boundary._plans) == 3  # Data; Data, list; Data, Data: each kept once, by its types


def test_the_c_form_copies_a_find_whose_keys_a_python_copy_found(epilogue, monkeypatch):
    """Once a copy in Python has found the keys down to a find, the C check copies the next
    steps' finds (new objects of the same types) itself: the only Python of the pack's that runs is
    the route's count and line. A step whose view sits elsewhere, or whose holder refuses the copy in
    place, goes back to the Python form. Every step's view leaves copied, its value kept, its route
    counted."""
    from sglang_dsv41_adapters.framework import metrics

    counted = []
    monkeypatch.setattr(metrics, "count_boundary_copy", counted.append)
    view = epilogue.commit_lens_buf[:4]

    def planted(field: str):
        result = decode_result(4)
        setattr(result, field, view)
        return result

    through_worker(decode_result(4), epilogue)  # the map, and the walk meets the types
    for field in ("accept_lens", "next_token_ids"):
        for step in range(4):
            epilogue.commit_lens_buf[:4] = torch.arange(4) + step
            handed, called = profiled(planted(field), epilogue)
            if step == 0:  # another field than the kept plan's: the Python form finds its key
                assert "_copied" in called, called
            else:
                assert called == ["through_worker", "check_results", "<lambda>", "_said_copy", "say_once"], called
            epilogue.commit_lens_buf[:4] = 99  # the next step rewrites the buffer
            assert getattr(handed, field).tolist() == [step, step + 1, step + 2, step + 3]
            assert counted[-1] == f"GenerationBatchResult.{field} <- DsparkVerifyEpilogue.commit_lens_buf"
    assert len(counted) == 8

    @dataclasses.dataclass(frozen=True)
    class Sealed:
        a: object

    for step in range(3):  # refused in place: the walk rebuilds it at each step, and no keys are kept for the C check
        handed, called = profiled(Data(Sealed(view)), epilogue)
        assert "_walk" in called and shares(handed, epilogue) == [] and type(handed.a) is Sealed
        assert (Data, Sealed) not in fence_boundary._plans
