"""The fence and its boundary check decide by memory, not by which object held it.

An engine may re-point a persistent buffer in place (`buf.set_(other)`, `buf.data = other`,
a `buf.resize_(...)` that changes its shape) or bind a new tensor in its place; and it may
keep tensors in a dict, a list or an object below the epilogue. In the first three the
tensor object stays the same: a fence that trusted the object would keep copying the views
it cut before (another step's values), and a storage map kept by object would hand the new
memory out uncopied. Each case is a doctored copy of the real sglang 0.5.23 dspark_verify:
its epilogue re-points its buffers itself, with a helper that names none of them (the
census, which reads names, lets the cheap form stand), or its folded branch hands out a
view of a tensor the epilogue keeps below it. Before each fenced call the engine's own call
runs unfenced on identical state; field by field, what the fence hands out equals it, at
several batch sizes, for PROOF_CALLS + 12 calls per batch size after each re-pointing, in
memory no tensor of the epilogue shares, also once the next step rewrote the buffers. Each
runs with the checks in Python and with the kernel file's C forms (conftest's sm80, built on
the CPU: they are host code).
"""

from __future__ import annotations

import gc
import sys
import types

import pytest
import torch

from sglang_dsv41_adapters import folded_fence
from sglang_dsv41_adapters.folded_fence import accept_snapshot, fence_boundary, fence_forms
from sglang_dsv41_adapters.framework import runtime
from harness.doctored import DoctoredEngine, doctored_module
from harness.fence import folded_kwargs
from tests.conftest import build_dspark

pytestmark = pytest.mark.timeout(300)  # the native variants may build the kernel file first (conftest's sm80)
V, FIELDS = folded_fence.VERIFY, folded_fence.FIELDS
BUFFERS = tuple(f"{name}_buf" for name in FIELDS)
CALLS = fence_forms.PROOF_CALLS + 12  # per batch size, after each re-pointing


@pytest.fixture(params=["python", "native"])
def checks(request, verify):
    """The cheap form's view test and the boundary's map test in Python, or in C (the kernel file)."""
    fence_boundary.reset()
    kernel = accept_snapshot.load(str(request.getfixturevalue("sm80")))[0] if request.param == "native" else None
    fence_boundary.use_native(kernel)
    accept_snapshot.use_checks(kernel)
    yield request.param
    accept_snapshot.use_checks(None)
    fence_boundary.use_native()
    fence_boundary.reset()
    runtime.revert()


def memory(epilogue, depth: int = 6) -> set:
    """The storages of every tensor the epilogue reaches (the garbage collector's view)."""
    found, seen, todo = set(), set(), [(epilogue, 0)]
    while todo:
        obj, level = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FunctionType, str, bytes, int, float)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.add(obj.untyped_storage().data_ptr())
        elif level < depth:
            todo += [(ref, level + 1) for ref in gc.get_referents(obj)]
    return found


def replay(tensors, step: int) -> None:
    """What a verify replay leaves: each tensor filled with values of this step only."""
    for t in tensors:
        t.copy_((torch.arange(t.numel(), device=t.device).view(t.shape) + 1000 * step + 1).to(t.dtype))


def engine_then_fence(dspark, original, sizes, calls: int, written, step: int) -> int:
    """For each batch size in turn, `calls` times: a replay, the engine's own folded call
    (unfenced), then the fenced call on the same state; the next replay; the fenced values
    must be the engine's, in memory the epilogue's tensors do not share. Returns the step reached."""
    for _ in range(calls):
        for bs in sizes:
            step += 1
            kwargs = folded_kwargs(bs, dspark.epilogue.bonus_buf.device)
            replay(written(), step)
            outs = original(dspark.executor, **kwargs)
            expected = {name: getattr(outs, name).clone() for name in FIELDS}
            fenced = dspark.executor.accept_and_finalize(**kwargs)
            replay(written(), step + 1000)
            shared = memory(dspark.epilogue)
            assert type(fenced) is type(outs)
            for name, value in expected.items():
                got = getattr(fenced, name)
                assert (got.dtype, got.shape) == (value.dtype, value.shape), (bs, name)
                assert torch.equal(got, value), (bs, name, step)
                assert got.untyped_storage().data_ptr() not in shared, (bs, name)
    return step


def fence_on(engine):
    decision = runtime.decide({folded_fence.FLAG: "1"}, engine, names=(folded_fence.NAME,))
    runtime.apply(decision)
    return next(p.wrapper for p in decision.plans[folded_fence.NAME].patches if p.name == "accept_and_finalize"), decision


# --- re-pointed buffers: the cheap form --------------------------------------------------------

READ_DEF = "    def read_accept(self, bs: int) -> AcceptOuts:\n"
# How the doctored epilogue's regrow() re-points each buffer; it names none of them.
REPOINTS = {
    "set_": "buf.set_(fresh)",
    ".data =": "buf.data = fresh",
    "resize_": "buf.resize_(fresh.shape)",
    "a new object": "setattr(self, name, fresh)",
}


def regrowing(tmp_path, how: str):
    """The real dspark_verify whose epilogue can regrow its per-request buffers to another
    max_bs (and its 2-D one to another width), re-pointing each as `how` says."""
    method = (
        "    def regrow(self, max_bs: int, width: int) -> None:  # doctored: every per-request buffer re-pointed\n"
        "        for name, buf in list(vars(self).items()):\n"
        "            if isinstance(buf, torch.Tensor) and name.endswith('_buf') and buf.shape[0] == self.max_bs:\n"
        "                shape = (max_bs,) + ((width,) if buf.dim() == 2 else ())\n"
        "                fresh = torch.zeros(shape, dtype=buf.dtype, device=buf.device)\n"
        f"                {REPOINTS[how]}\n"
        "        self.max_bs = max_bs\n\n"
    )
    module = doctored_module(V, (READ_DEF, method + READ_DEF), directory=tmp_path)
    return module, DoctoredEngine({V: module})


@pytest.mark.parametrize("how", list(REPOINTS))
def test_the_cheap_form_copies_a_repointed_buffer_from_its_new_memory(how, checks, tmp_path, monkeypatch):
    through_repointings(how, tmp_path, monkeypatch, "cpu")


def through_repointings(how: str, tmp_path, monkeypatch, device) -> None:
    """The cheap form on a regrowing epilogue (on `device`): proven and trusted at 1, 5 and 16
    rows, then re-pointed twice; each time proven again per batch size, then trusted, and
    every call the engine's own values (tests/test_fence_gpu.py runs it on CUDA)."""
    module, engine = regrowing(tmp_path, how)
    dspark = build_dspark(module, device=device)
    original = vars(module.TargetVerifyExecutor)["accept_and_finalize"]
    form, decision = fence_on(engine)
    assert isinstance(form, fence_forms.CheapForm), decision.outcomes[0].reason
    proofs = []
    traced = fence_forms.traced
    monkeypatch.setattr(fence_forms, "traced", lambda *a: proofs.append(a[2]["bs"]) or traced(*a))
    written = lambda: [getattr(dspark.epilogue, name) for name in BUFFERS]  # noqa: E731 - read at each replay
    step = engine_then_fence(dspark, original, (1, 5, 16), CALLS, written, 0)
    assert form.trusted == {1, 5, 16} and sorted(proofs) == sorted([1, 5, 16] * fence_forms.PROOF_CALLS)
    for max_bs, width, sizes in ((24, 6, (1, 5, 16, 20)), (16, 4, (1, 5, 16, 20))):  # grown, then back
        dspark.epilogue.regrow(max_bs, width)
        proofs.clear()
        step = engine_then_fence(dspark, original, sizes, CALLS, written, step)
        # each batch size proven again on its new views, then trusted
        assert form.off is None and form.trusted == set(sizes), form.off
        assert sorted(proofs) == sorted(list(sizes) * fence_forms.PROOF_CALLS), proofs


def test_the_views_test_compares_memory_not_objects(checks):
    """accept_snapshot.current on one buffer and an alias taken when its views were cut: each
    way of re-pointing it in place is seen, and each change of the memory's layout."""
    changes = {
        "set_ to other memory": lambda buf: buf.set_(torch.zeros(16, 4, dtype=torch.int64)),
        ".data = other memory": lambda buf: setattr(buf, "data", torch.zeros(16, 4, dtype=torch.int64)),
        "resize_ to another width": lambda buf: buf.resize_(16, 6),
        "resize_ to fewer rows": lambda buf: buf.resize_(3, 4),
        "resize_ to more rows": lambda buf: buf.resize_(24, 4),
        "set_ to an offset": lambda buf: buf.set_(buf.untyped_storage(), 4, (15, 4), (4, 1)),
        "set_ to other strides": lambda buf: buf.set_(buf.untyped_storage(), 0, (16, 4), (1, 16)),
        ".data = another dtype": lambda buf: setattr(buf, "data", buf.view(torch.float64)),
    }
    for name, change in changes.items():
        buf = torch.zeros(16, 4, dtype=torch.int64)
        was = (buf.detach(),)
        assert accept_snapshot.current((buf,), (buf,), was), name
        assert not accept_snapshot.current((buf,), (buf.view(16, 4),), was)  # another object over the same memory
        change(buf)
        assert not accept_snapshot.current((buf,), (buf,), was), name
        assert accept_snapshot.current((buf,), (buf,), (buf.detach(),)), name  # views cut again: current again


# --- re-pointed buffers: the general form and the boundary ------------------------------------

def test_the_general_form_and_the_boundary_copy_a_repointed_buffer(checks, tmp_path):
    """read_accept decorated: the general form, whose storage map must follow the buffers; the
    worker's result (the boundary) likewise, with a view planted the fence does not see."""
    decorated = ("import functools\n\n\ndef _plain(method):\n    @functools.wraps(method)\n"
                 "    def wrapper(*args, **kwargs):\n        return method(*args, **kwargs)\n    return wrapper\n\n\n")
    module = doctored_module(V, ("class TargetVerifyExecutor:\n", decorated + "class TargetVerifyExecutor:\n"),
                             (READ_DEF, "    @_plain\n" + READ_DEF), directory=tmp_path)
    dspark = build_dspark(module)
    original = vars(module.TargetVerifyExecutor)["accept_and_finalize"]
    form, _ = fence_on(DoctoredEngine({V: module}))
    assert form is folded_fence.GENERAL_FOLDED
    written = lambda: [getattr(dspark.epilogue, name) for name in BUFFERS]  # noqa: E731
    step = engine_then_fence(dspark, original, (1, 5), 2, written, 0)
    changes = {"set_": lambda b: b.set_(torch.zeros_like(b)), ".data =": lambda b: setattr(b, "data", torch.zeros_like(b)),
               "resize_": lambda b: b.resize_((40,) + b.shape[1:]),
               "swap_tensors": lambda b: torch.utils.swap_tensors(b, torch.zeros_like(b))}  # the object keeps, its tensor goes
    for change in changes.values():
        for name in BUFFERS:
            change(getattr(dspark.epilogue, name))
        step = engine_then_fence(dspark, original, (1, 5, 16), CALLS, written, step)
        for bs in (1, 5, 16):  # the worker's result holding a view of a re-pointed buffer
            result, values = leave_worker(dspark.epilogue, lambda e: e.bonus_buf[:bs], step)
            assert_copied(result, values, dspark.epilogue)


def assert_copied(result, values, epilogue) -> None:
    """The view that left the worker holds `values`, in memory no tensor of the epilogue shares."""
    assert torch.equal(result.new_seq_lens, values)
    assert result.new_seq_lens.untyped_storage().data_ptr() not in memory(epilogue)


def leave_worker(epilogue, view, step: int):
    """A GenerationBatchResult whose new_seq_lens is `view(epilogue)` through the boundary
    check as the plan wraps the worker's return; then the next replay. Returns (what the
    worker returned, the view's values at this step)."""
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.speculative.dspark_components import dspark_worker_v2 as worker_module

    worker = object.__new__(worker_module.DSparkWorkerV2)
    worker._verify_epilogue = epilogue
    tensor = view(epilogue)
    replay([tensor], step)
    values = tensor.clone()
    result = fence_boundary.check_results(lambda self, batch: GenerationBatchResult(new_seq_lens=view(epilogue)),
                                          worker, (worker, None), {})
    replay([tensor], step + 1000)
    return result, values


# --- tensors the epilogue keeps below it ---------------------------------------------------------

BRANCH = ("            self.verify_epilogue.note_static_verify(bs)\n"
          "            return self.verify_epilogue.read_accept(bs)\n")
# The folded branch with five fields cloned (a partial fix) and new_seq_lens read from `route`.
PARTIAL = ("            self.verify_epilogue.note_static_verify(bs)\n"
           "            outs, held = self.verify_epilogue.read_accept(bs), self.verify_epilogue\n"
           "            return AcceptOuts(correct_len=outs.correct_len.clone(), bonus=outs.bonus.clone(),\n"
           "                              cap_trim_lens=outs.cap_trim_lens.clone(), commit_lens=outs.commit_lens.clone(),\n"
           "                              new_seq_lens={route}[:bs], out_tokens=outs.out_tokens.clone())\n")
INIT_END = "        self.static_io: dict[int, StaticVerifyIO] = {}\n"
# (where the doctored epilogue keeps its relay lengths, set at the end of __init__; the route
# its folded branch reads them by; where the boundary says it found them)
HOLDERS = {
    "a dict of structs (static_io[bs].seq_lens)": ("", "held.static_io[bs].seq_lens", "static_io[1].seq_lens"),
    "a list": ("        self.relay_lens = [torch.zeros((self.max_bs,), dtype=torch.int64, device=device)]\n",
               "held.relay_lens[0]", "relay_lens[]"),
    "a dict of lists": ("        self.relay = {'lens': [None, torch.zeros((self.max_bs,), dtype=torch.int64, device=device)]}\n",
                        "held.relay['lens'][1]", "relay['lens'][]"),
    "an object two levels down": (
        "        self.relay = types.SimpleNamespace(inner=types.SimpleNamespace(\n"
        "            lens=torch.zeros((self.max_bs,), dtype=torch.int64, device=device)))\n", "held.relay.inner.lens",
        "relay.inner.lens"),
}


def keeping(tmp_path, where: str):
    init, route, _ = HOLDERS[where]
    module = doctored_module(V, ("class TargetVerifyExecutor:\n", "import types\n\n\nclass TargetVerifyExecutor:\n"),
                             (INIT_END, INIT_END + init), (BRANCH, PARTIAL.format(route=route)), directory=tmp_path)
    return module, DoctoredEngine({V: module}), route.replace("held.", "epilogue.")


def capture(module, epilogue, sizes) -> torch.Tensor:
    """static_io as capture leaves it (_static_epilogue): per batch size, views of the graph
    runner's persistent inputs. Returns those inputs' seq_lens."""
    seq_lens = torch.zeros(epilogue.max_bs, dtype=torch.int64)
    for bs in sizes:
        ids = torch.zeros(bs * epilogue.stride, dtype=torch.int64)
        epilogue.static_io[bs] = module.StaticVerifyIO(
            candidates=ids.view(bs, epilogue.stride), logits=torch.zeros(bs * epilogue.stride, 8),
            hidden=torch.zeros(bs * epilogue.stride, 4), seq_lens=seq_lens[:bs], req_pool_indices=ids[:bs],
            out_cache_loc=ids, positions=ids)
    return seq_lens


@pytest.mark.parametrize("where", list(HOLDERS))
def test_a_view_of_a_tensor_the_epilogue_keeps_below_it_is_copied(where, checks, tmp_path, capfd):
    module, engine, route = keeping(tmp_path, where)
    dspark = build_dspark(module)
    sizes = (1, 5, 16)
    epilogue = dspark.epilogue
    held = lambda: eval(route, {"epilogue": epilogue, "bs": sizes[-1]})  # noqa: E731 - the tensor the route reads
    if where.startswith("a dict of structs"):
        capture(module, epilogue, sizes)
    original = vars(module.TargetVerifyExecutor)["accept_and_finalize"]
    form, decision = fence_on(engine)
    assert form is folded_fence.GENERAL_FOLDED and "the folded branch is not" in decision.outcomes[0].reason
    written = lambda: [getattr(epilogue, name) for name in BUFFERS] + [held()]  # noqa: E731
    step = engine_then_fence(dspark, original, sizes, CALLS, written, 0)
    for bs in sizes:  # the same view leaving the worker: copied, and its route named once
        result, values = leave_worker(epilogue, lambda e: held()[:bs], step)
        assert_copied(result, values, epilogue)
    said = [line for line in capfd.readouterr().err.splitlines() if "boundary: GenerationBatchResult.new_seq_lens" in line]
    assert len(said) == 1 and said[0].split(" <- ")[1].startswith(f"DsparkVerifyEpilogue.{HOLDERS[where][2]} shared"), said
    # the tensor re-pointed, then replaced, and (static_io) a batch size captured later: followed
    changes = [lambda: held().set_(torch.zeros(24, dtype=torch.int64))]
    if where.startswith("a dict of structs"):
        changes.append(lambda: capture(module, epilogue, sizes + (20,)))
    for change in changes:
        change()
        step = engine_then_fence(dspark, original, sizes, CALLS, written, step)
        for bs in sizes:
            result, values = leave_worker(epilogue, lambda e: held()[:bs], step)
            assert_copied(result, values, epilogue)


def test_a_map_made_for_a_dead_epilogue_is_not_read_for_another_at_its_id(checks, verify):
    """An id reused after the epilogue it was mapped for died (the garbage collector's doing):
    the map is the dead one's, so it is made again, and the new epilogue's buffers are found."""
    first = build_dspark(verify).epilogue
    fence_boundary.persistent_storages(first)
    second = build_dspark(verify).epilogue
    fence_boundary._storages[id(second)] = fence_boundary._storages.pop(id(first))  # as if second took first's id
    del first
    gc.collect()
    result, values = leave_worker(second, lambda e: e.commit_lens_buf[:4], 1)
    assert_copied(result, values, second)
    assert fence_boundary._storages[id(second)][0]() is second


def test_the_step_results_the_relay_keeps_are_not_the_epilogues_memory(checks, capfd):
    """0.5.23's FutureRelayBuffers keeps the step's outputs (the fence's copies, which the result
    holds too) in published_*: not memory of the epilogue's own. Its buffers are."""
    from sglang.srt.managers.overlap_utils import FutureRelayBuffers
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.speculative.dspark_components import dspark_verify

    epilogue = build_dspark(dspark_verify).epilogue
    epilogue.future_relay = FutureRelayBuffers(req_pool_size=32, device="cpu")
    worker = types.SimpleNamespace(_verify_epilogue=epilogue)
    for step in range(1, 6):
        bonus = epilogue.bonus_buf[:4].clone()  # the fence's copy
        epilogue.future_relay.published_bonus = bonus
        step = lambda w, b: GenerationBatchResult(new_seq_lens=bonus)  # noqa: E731 - the worker's return
        result = fence_boundary.check_results(step, worker, (worker, None), {})
        assert result.new_seq_lens is bonus
    result, values = leave_worker(epilogue, lambda e: e.future_relay.output_tokens[:4], 7)
    assert_copied(result, values, epilogue)
    assert "future_relay.published_bonus" not in capfd.readouterr().err


def test_a_draft_model_below_the_epilogue_is_mapped_and_the_scan_still_serves(checks, verify, monkeypatch):
    """0.5.23's epilogue holds its commit context, and through it the draft model (an nn.Module,
    whose hooks sit in OrderedDicts): its parameters are mapped, a view of one leaving the
    worker is copied, and with the kernel file a clean step is still the native scan's alone."""
    from bench.fence_host_cost import decode_result

    epilogue = build_dspark(verify).epilogue
    draft = torch.nn.Linear(4, 4)
    epilogue.commit_ctx = verify.CommitInjectCtx(draft_model=draft, block_pos_offsets=torch.arange(4),
                                                 resolve_pool=lambda: None, resolve_req_to_token=lambda: None)
    walks = []
    walk = fence_boundary._walk
    monkeypatch.setattr(fence_boundary, "_walk", lambda result, e: walks.append(result) or walk(result, e))
    worker = types.SimpleNamespace(_verify_epilogue=epilogue)
    for step in range(4):
        clean = decode_result(4)
        assert fence_boundary.check_results(lambda w, b: clean, worker, (worker, None), {}) is clean
        if step == 0:
            walks.clear()  # the first may walk: the walk meets the types
    assert len(walks) == (0 if checks == "native" else 3), len(walks)
    for view in (lambda e: e.commit_ctx.block_pos_offsets[:2], lambda e: e.commit_ctx.draft_model.weight[0].detach()):
        result, values = leave_worker(epilogue, view, 9)
        assert_copied(result, values, epilogue)


# --- the trusted call in C ----------------------------------------------------------------------

def pack_frames(call) -> tuple:
    """(call's value, the pack's Python functions it ran, by name)."""
    ran = []
    sys.setprofile(lambda frame, event, arg: event == "call" and "sglang_dsv41_adapters" in frame.f_code.co_filename
                   and ran.append(frame.f_code.co_name))
    try:
        return call(), ran
    finally:
        sys.setprofile(None)


def test_a_trusted_call_is_the_libraries_where_it_tests_the_views_and_the_rest_the_forms(checks, verify):
    """Once a batch size is trusted with the kernel file's C forms, the executor's class holds the
    library's fenced_method: a trusted call runs no Python of the pack's and hands out the engine's
    values in memory of its own; a batch size not trusted, the views tested in Python again and
    a buffer re-pointed go to the Python form (which proves the last again). With the checks in
    Python, the Python form serves every call. Reverting puts the engine's function back."""
    dspark = build_dspark(verify)
    cls, executor = verify.TargetVerifyExecutor, dspark.executor
    original = vars(cls)["accept_and_finalize"]
    form = next(p.wrapper for p in fence_on(None)[1].plans[folded_fence.NAME].patches if p.name == "accept_and_finalize")
    assert isinstance(form, fence_forms.CheapForm)
    written = lambda: [getattr(dspark.epilogue, name) for name in BUFFERS]  # noqa: E731
    step = engine_then_fence(dspark, original, (1, 5), fence_forms.PROOF_CALLS + 2, written, 0)
    bound = vars(cls)["accept_and_finalize"]
    if checks == "python":  # whichever binding the class holds, the Python form serves each call
        _, ran = pack_frames(lambda: executor.accept_and_finalize(**folded_kwargs(5, "cpu")))
        assert "__call__" in ran and "_engine_path" not in ran
        return
    assert type(bound).__name__ == "fenced_method" and bound.__wrapped__ is original
    assert bound.__code__ is original.__code__ and bound.__name__ == "accept_and_finalize"
    replay(written(), 7)
    fenced, ran = pack_frames(lambda: executor.accept_and_finalize(**folded_kwargs(5, "cpu")))
    engine = original(executor, **folded_kwargs(5, "cpu"))
    assert ran == [] and all(torch.equal(getattr(fenced, name), getattr(engine, name)) for name in FIELDS)
    assert not {getattr(fenced, name).untyped_storage().data_ptr() for name in FIELDS} & memory(dspark.epilogue)
    _, ran = pack_frames(lambda: executor.accept_and_finalize(**folded_kwargs(9, "cpu")))  # not trusted yet
    assert "__call__" in ran and "_engine_path" in ran
    _, ran = pack_frames(lambda: cls.accept_and_finalize(executor, **folded_kwargs(1, "cpu")))  # on the class: as bound
    assert ran == []
    library = accept_snapshot.checks_library()
    accept_snapshot.use_checks(None)  # the views tested in Python: the form serves every call
    _, ran = pack_frames(lambda: executor.accept_and_finalize(**folded_kwargs(1, "cpu")))
    assert "__call__" in ran and "_engine_path" not in ran
    accept_snapshot.use_checks(library)
    dspark.epilogue.commit_lens_buf.set_(torch.zeros_like(dspark.epilogue.commit_lens_buf))  # re-pointed in place
    _, ran = pack_frames(lambda: executor.accept_and_finalize(**folded_kwargs(1, "cpu")))
    assert "_engine_path" in ran and 1 not in form.trusted  # proven again on its new memory
    engine_then_fence(dspark, original, (1, 5), fence_forms.PROOF_CALLS + 2, written, step)
    runtime.revert()
    assert vars(cls)["accept_and_finalize"] is original
