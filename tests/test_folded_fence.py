"""The folded-result fence on the real sglang 0.5.23 DSpark modules, on the CPU."""

from __future__ import annotations

import importlib.util
import inspect
import pathlib
import shutil
import types

import pytest
import torch

from sglang_dsv41_adapters.folded_fence import accept_snapshot, fence_forms
from sglang_dsv41_adapters import folded_fence
from sglang_dsv41_adapters.framework import patching, runtime
from tests.conftest import Step, accept_kwargs
from harness.doctored import DoctoredEngine, Drift, doctored_module

SITE_PACKAGES = pathlib.Path(importlib.util.find_spec("sglang").origin).parent.parent

FIELDS = folded_fence.FIELDS
BATCH_SIZES = (1, 5, 16)


def shares_memory(tensor: torch.Tensor, buffer: torch.Tensor) -> bool:
    return tensor.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def aliased_fields(outs, epilogue) -> list[str]:
    return [f for f in FIELDS if shares_memory(getattr(outs, f), getattr(epilogue, f"{f}_buf"))]


def fence_on() -> runtime.Decision:
    """Switch the fence on in this process, as the launcher and every rank do."""
    decision = runtime.decide({folded_fence.FLAG: "1"}, names=(folded_fence.NAME,))
    runtime.apply(decision)
    return decision


def folded_step(dspark, bs: int):
    """Step N lands in the buffers, the folded accept hands out its result, step N+1 lands."""
    step_n, step_next = Step(1, bs, dspark.stride), Step(2, bs, dspark.stride)
    step_n.write(dspark.epilogue)
    outs = dspark.executor.accept_and_finalize(**accept_kwargs(dspark.module, bs=bs, stride=dspark.stride, folded=True))
    step_next.write(dspark.epilogue)
    return outs, step_n, step_next


@pytest.mark.parametrize("bs", BATCH_SIZES)
def test_without_fence_folded_result_aliases_the_buffers(dspark, bs):
    outs, step_n, step_next = folded_step(dspark, bs)
    assert aliased_fields(outs, dspark.epilogue) == list(FIELDS)
    # The hazard: a late reader of step N's result sees step N+1.
    assert all(step_next.matches(outs).values())


@pytest.mark.parametrize("bs", BATCH_SIZES)
def test_fence_detaches_folded_result_and_keeps_step_n(dspark, bs):
    assert fence_on().outcomes[0].state == runtime.APPLIED
    outs, step_n, _ = folded_step(dspark, bs)
    assert aliased_fields(outs, dspark.epilogue) == []
    assert step_n.matches(outs) == {f: True for f in FIELDS}
    assert type(outs) is dspark.module.AcceptOuts


def sampling_region(dspark, bs: int):
    """The real 0.5.23 DsparkSamplingAcceptGraph, with one captured region per batch size.

    A CUDA graph cannot be captured on the CPU, so the captured graph of this key is
    an object whose replay() does what the real replay does to the buffers: it
    writes this step's accept into them."""
    from sglang.srt.speculative.dspark_components import dspark_sampling_accept_graph as sag

    epilogue, stride = dspark.epilogue, dspark.stride
    logits = torch.zeros(bs * stride, 17)
    epilogue.static_io[bs] = dspark.module.StaticVerifyIO(
        candidates=torch.zeros(bs, stride, dtype=torch.int64), logits=logits, hidden=torch.zeros(bs * stride, 2),
        seq_lens=torch.zeros(bs, dtype=torch.int64), req_pool_indices=torch.zeros(bs, dtype=torch.int64),
        out_cache_loc=torch.zeros(bs * stride, dtype=torch.int64), positions=torch.zeros(bs * stride, dtype=torch.int64),
    )
    sampler = types.SimpleNamespace(greedy_draft=True, step_logits=None, params=types.SimpleNamespace(temperatures=torch.ones(bs)))
    region = sag.DsparkSamplingAcceptGraph(
        epilogue=epilogue, resolve_draft_sampler=lambda: sampler, tp_sync=dspark.tp_sync,
        fused_argmax=False, block_verification=False, device="cpu",
    )
    key = (bs, logits.data_ptr(), sampler.params.temperatures.data_ptr(), 0)
    step_n = Step(1, bs, stride)
    region._graphs[key] = types.SimpleNamespace(replay=lambda: step_n.write(epilogue))
    return sag, region, logits, step_n


@pytest.mark.parametrize("bs", BATCH_SIZES)
def test_fence_covers_the_sampling_accept_graph_route(dspark, bs):
    sag, region, logits, step_n = sampling_region(dspark, bs)
    step_next = Step(2, bs, dspark.stride)
    unfenced = region.run(bs=bs, target_logits=logits)
    step_next.write(dspark.epilogue)
    assert region.num_replays == 1
    assert aliased_fields(unfenced, dspark.epilogue) == list(FIELDS)
    assert all(step_next.matches(unfenced).values())

    fence_on()
    fenced = region.run(bs=bs, target_logits=logits)
    step_next.write(dspark.epilogue)
    assert region.num_replays == 2
    assert aliased_fields(fenced, dspark.epilogue) == []
    assert step_n.matches(fenced) == {f: True for f in FIELDS}
    # A step the region declines still returns None, fenced or not.
    assert region.run(bs=bs, target_logits=torch.zeros_like(logits)) is None


def test_fence_covers_the_block_accept_lens_route(dspark):
    """0.5.23 hands a view of block_accept_lens_buf to the batch result when the
    post-forward graph is on; the real DSparkWorkerV2._block_accept_lens is called."""
    from sglang.srt.speculative.dspark_components import dspark_worker_v2 as worker_module

    bs = 6
    dspark.epilogue.block_accept_lens_buf = torch.zeros(16, dtype=torch.int32)
    dspark.epilogue.block_accept_lens_buf[:bs] = torch.arange(bs, dtype=torch.int32) + 7
    worker = object.__new__(worker_module.DSparkWorkerV2)
    worker._verify_epilogue = dspark.epilogue
    accept = dspark.module.AcceptOuts(**{f: torch.ones(bs, dtype=torch.int32) for f in FIELDS})

    view = worker._block_accept_lens(accept=accept, folded_accept=True, bs=bs)
    assert shares_memory(view, dspark.epilogue.block_accept_lens_buf)
    fence_on()
    fenced = worker._block_accept_lens(accept=accept, folded_accept=True, bs=bs)
    dspark.epilogue.block_accept_lens_buf.fill_(-1)
    assert not shares_memory(fenced, dspark.epilogue.block_accept_lens_buf)
    assert fenced.tolist() == [7, 8, 9, 10, 11, 12]
    eager = worker._block_accept_lens(accept=accept, folded_accept=False, bs=bs)
    assert eager.tolist() == [2] * bs


def test_eager_path_returns_what_it_returned_before(dspark):
    kwargs = dict(bs=7, stride=dspark.stride, folded=False, seed=3)
    before = dspark.executor.accept_and_finalize(**accept_kwargs(dspark.module, **kwargs))
    plan = fence_on().plans[folded_fence.NAME]
    after = dspark.executor.accept_and_finalize(**accept_kwargs(dspark.module, **kwargs))
    for name in FIELDS:
        assert torch.equal(getattr(before, name), getattr(after, name)), name
        assert getattr(before, name).dtype == getattr(after, name).dtype
    # The wrapper hands an eager result that shares no buffer through as the very same object.
    fresh = dspark.module.AcceptOuts(**{f: torch.arange(3) for f in FIELDS})
    fence = next(p.wrapper for p in plan.patches if p.where == "TargetVerifyExecutor.accept_and_finalize")
    assert fence(lambda **kw: fresh, dspark.executor, (), {"folded_accept": False}) is fresh


def test_applying_twice_wraps_once_and_revert_restores(verify):
    cls = verify.TargetVerifyExecutor
    original = vars(cls)["accept_and_finalize"]
    signature = inspect.signature(cls.accept_and_finalize)
    fence_on()
    fence_on()
    wrapper = vars(cls)["accept_and_finalize"]
    assert wrapper is not original and patching.original(cls, "accept_and_finalize") is original
    assert wrapper.__wrapped__ is original  # one layer, not two
    assert inspect.signature(cls.accept_and_finalize) == signature
    assert cls.accept_and_finalize.__name__ == "accept_and_finalize"
    assert {(s.adapter, s.name) for s in patching.applied()} == {
        ("folded_fence", "accept_and_finalize"), ("folded_fence", "run"), ("folded_fence", "_block_accept_lens"),
        ("folded_fence", "forward_batch_generation")}
    runtime.revert()
    assert vars(cls)["accept_and_finalize"] is original
    assert patching.applied() == []


def test_deciding_patches_nothing(verify):
    original = vars(verify.TargetVerifyExecutor)["accept_and_finalize"]
    decision = runtime.decide({folded_fence.FLAG: "1"}, names=(folded_fence.NAME,))
    plan = decision.plans[folded_fence.NAME]
    assert plan.state == "applied"
    assert [p.where for p in plan.patches] == [
        "TargetVerifyExecutor.accept_and_finalize", "DsparkSamplingAcceptGraph.run", "DSparkWorkerV2._block_accept_lens",
        "DSparkWorkerV2.forward_batch_generation"]
    assert patching.applied() == [] and vars(verify.TargetVerifyExecutor)["accept_and_finalize"] is original
    assert patching.original(verify.TargetVerifyExecutor, "accept_and_finalize") is None


# Each doctored copy of the real dspark_verify differs from it in one place.
V = folded_fence.VERIFY
DRIFTS = {
    "method renamed": Drift(V, "    def accept_and_finalize(\n", "    def accept_and_finalise(\n",
                            "TargetVerifyExecutor.accept_and_finalize"),
    "keyword renamed": Drift(V, "        folded_accept: bool,\n", "        fold_accept: bool,\n",
                             "parameter 'folded_accept' is gone"),
    "AcceptOuts field renamed": Drift(V, "class AcceptOuts(msgspec.Struct):\n    correct_len:",
                                      "class AcceptOuts(msgspec.Struct):\n    accepted_len:", "AcceptOuts: fields are ('accepted_len'"),
    "one more escape route": Drift(V, "    def accept_and_finalize(\n", "    def peek_accept(self, bs):\n"
                                   "        return self.verify_epilogue.read_accept(bs)\n\n    def accept_and_finalize(\n",
                                   "TargetVerifyExecutor.peek_accept: line"),
    "read_accept re-signatured": Drift(V, "    def read_accept(self, bs: int) -> AcceptOuts:\n",
                                       "    def read_accept(self, batch_size: int) -> AcceptOuts:\n        bs = batch_size\n",
                                       "DsparkVerifyEpilogue.read_accept: parameter 'bs' is gone"),
    "folded path returns something else": Drift(V, "            return self.verify_epilogue.read_accept(bs)\n",
                                                "            return self.verify_epilogue.accept_views(bs)\n",
                                                "no longer returns read_accept(bs)"),
}


@pytest.mark.parametrize("name", sorted(DRIFTS))
def test_drifted_copies_are_refused_naming_the_symbol(name, tmp_path):
    drift = DRIFTS[name]
    outcome = drift.outcome(folded_fence, "1", directory=tmp_path)
    assert outcome.state == runtime.REFUSED
    assert drift.symbol in outcome.reason
    assert outcome.reason.startswith(f"folded_fence refused on sglang 0.5.23: {V}:")
    assert patching.applied() == []  # nothing was patched on the way to the refusal


READ_ACCEPT_DEF = "    def read_accept(self, bs: int) -> AcceptOuts:\n"


def decide_with_snapshot(tmp_path, snapshot_accept: str):
    """The fence's decision on a doctored copy of the real 0.5.23 module whose epilogue has
    `snapshot_accept` (its source) and whose folded path returns it, as upstream's fix does."""
    module = doctored_module(
        V,
        ("            return self.verify_epilogue.read_accept(bs)\n", "            return self.verify_epilogue.snapshot_accept(bs)\n"),
        (READ_ACCEPT_DEF, snapshot_accept + READ_ACCEPT_DEF),
        directory=tmp_path,
    )
    return runtime.decide({folded_fence.FLAG: "1"}, DoctoredEngine({V: module}), names=(folded_fence.NAME,))


def test_copy_that_already_detaches_is_superseded(tmp_path):
    """The upstream fix (snapshot_accept) as a doctored copy of the real module."""
    decision = decide_with_snapshot(tmp_path, (
        "    def snapshot_accept(self, bs: int) -> AcceptOuts:\n"
        "        views = self.read_accept(bs)\n"
        "        return AcceptOuts(**{f: getattr(views, f).clone() for f in AcceptOuts.__struct_fields__})\n\n"
    ))
    # The two other routes of 0.5.23 are still fenced; accept_and_finalize is left alone.
    assert decision.outcomes[0].state == runtime.APPLIED
    assert "DsparkVerifyEpilogue.snapshot_accept" in decision.outcomes[0].reason
    assert "TargetVerifyExecutor.accept_and_finalize" not in [p.where for p in decision.plans["folded_fence"].patches]


# --- the cheap form: the folded branch done by the fence, checked before it is replicated ---

def folded_wrapper(decision):
    return next(p.wrapper for p in decision.plans[folded_fence.NAME].patches
                if p.where == "TargetVerifyExecutor.accept_and_finalize")


@pytest.mark.parametrize("release, notes", [("0.5.23", True), ("0.5.18", False)])
def test_cheap_form_replicates_each_releases_folded_branch(release, notes):
    """0.5.23's folded branch calls note_static_verify(bs) before read_accept(bs), 0.5.18's
    does not: the fence does exactly what each release's branch does."""
    from sglang_dsv41_adapters.engine.source_engine import SourceEngine
    from harness.engines import ENGINE_PATHS

    engine = None if release == "0.5.23" else SourceEngine(ENGINE_PATHS[release][0])
    wrapper = folded_wrapper(runtime.decide({folded_fence.FLAG: "1"}, engine, names=(folded_fence.NAME,)))
    assert isinstance(wrapper, fence_forms.CheapForm)
    assert wrapper.notes is notes
    assert wrapper.buffers(types.SimpleNamespace(**{f"{f}_buf": f for f in FIELDS})) == FIELDS


def test_cheap_form_notes_the_static_verify_and_follows_a_replaced_buffer(dspark):
    fence_on()
    noted = []
    dspark.epilogue.deferred_commit = types.SimpleNamespace(note_static_verify=noted.append)
    outs, step_n, _ = folded_step(dspark, 5)
    assert noted == [5] and step_n.matches(outs) == {f: True for f in FIELDS}
    # The engine swaps a buffer for a new one: the cached views follow it.
    dspark.epilogue.bonus_buf = torch.full_like(dspark.epilogue.bonus_buf, 77)
    outs, _, _ = folded_step(dspark, 5)
    assert outs.bonus.tolist() == [1002, 1003, 1004, 1005, 1006]  # step N, written into the new buffer
    assert aliased_fields(outs, dspark.epilogue) == []


REPLICATION_DRIFTS = {
    "folded branch does one more thing": (
        "            self.verify_epilogue.note_static_verify(bs)\n",
        "            self.verify_epilogue.note_static_verify(bs)\n            self._folded_steps = bs\n"),
    "read_accept reads a field another way": (
        "            bonus=self.bonus_buf[:bs],\n", "            bonus=self.bonus_buf[:bs].view(-1),\n"),
}


@pytest.mark.parametrize("name", sorted(REPLICATION_DRIFTS))
def test_drift_in_what_the_cheap_form_replicates_falls_back_to_copying_the_result(name, tmp_path):
    """The cheap form replicates the folded branch and read_accept; any other shape of
    them gets the general form (run the engine's path, copy its result), still fenced."""
    module = doctored_module(V, REPLICATION_DRIFTS[name], directory=tmp_path)
    decision = runtime.decide({folded_fence.FLAG: "1"}, DoctoredEngine({V: module}), names=(folded_fence.NAME,))
    assert decision.outcomes[0].state == runtime.APPLIED
    assert folded_wrapper(decision) is folded_fence.GENERAL_FOLDED


def test_keyword_only_struct_is_rebuilt_by_keyword(tmp_path):
    module = doctored_module(V, ("class AcceptOuts(msgspec.Struct):", "class AcceptOuts(msgspec.Struct, kw_only=True):"),
                             directory=tmp_path)
    decision = runtime.decide({folded_fence.FLAG: "1"}, DoctoredEngine({V: module}), names=(folded_fence.NAME,))
    assert decision.outcomes[0].state == runtime.APPLIED
    views = {f: torch.arange(3) for f in FIELDS}
    copy = accept_snapshot.detach(module.AcceptOuts(**views), FIELDS)
    assert type(copy) is module.AcceptOuts and all(torch.equal(getattr(copy, f), views[f]) for f in FIELDS)


def test_struct_built_another_way_takes_the_general_form(tmp_path):
    """A struct with its own __init__: the general form copies it without building it anew,
    the cheap form (which builds it as read_accept does) is not used; read from source the
    way doctor --engine reads it."""
    from sglang_dsv41_adapters.engine.source_engine import SourceEngine

    root = tmp_path / "engine"
    shutil.copytree(SITE_PACKAGES / "sglang", root / "sglang",
                    ignore=lambda folder, names: [n for n in names if not n.endswith(".py") and not (pathlib.Path(folder) / n).is_dir()])
    path = root / "sglang" / "srt" / "speculative" / "dspark_components" / "dspark_verify.py"
    text = path.read_text()
    path.write_text(text.replace("    out_tokens: torch.Tensor\n",
                                 "    out_tokens: torch.Tensor\n\n    def __init__(self, *fields):\n        pass\n", 1))
    decision = runtime.decide({folded_fence.FLAG: "1"}, SourceEngine(root), names=(folded_fence.NAME,))
    assert decision.outcomes[0].state == runtime.APPLIED
    assert "general form on TargetVerifyExecutor.accept_and_finalize: AcceptOuts runs code of its own" in decision.outcomes[0].reason
    assert folded_wrapper(decision) is folded_fence.GENERAL_FOLDED


def test_snapshot_that_copies_four_of_six_fields_is_not_taken_for_the_fix(tmp_path):
    decision = decide_with_snapshot(tmp_path, (
        "    def snapshot_accept(self, bs: int) -> AcceptOuts:\n"
        "        views = self.read_accept(bs)\n"
        "        return AcceptOuts(correct_len=views.correct_len.clone(), bonus=views.bonus.clone(),\n"
        "                          cap_trim_lens=views.cap_trim_lens.clone(), commit_lens=views.commit_lens.clone(),\n"
        "                          new_seq_lens=views.new_seq_lens, out_tokens=views.out_tokens)\n\n"
    ))
    assert decision.outcomes[0].state == runtime.APPLIED
    assert "snapshot_accept is not shown to clone every field" in decision.outcomes[0].reason
    assert folded_wrapper(decision) is folded_fence.GENERAL_FOLDED


# --- the boundary: results leaving the worker are checked, whatever route they took ---

def test_boundary_copies_a_result_that_escaped_by_an_unknown_route(dspark, capfd):
    """A result that reached the worker's return through a route the fence does not know
    (here built by hand from the buffers) is copied where it leaves the worker, keeps step
    N after the buffers are rewritten, and the route is named once per process."""
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.speculative.dspark_components import dspark_worker_v2 as worker_module
    from sglang_dsv41_adapters.folded_fence import fence_boundary

    bs = 4
    fence_boundary.reset()  # "once per process": routes another test file already reported in this worker are forgotten
    fence_on()
    worker = object.__new__(worker_module.DSparkWorkerV2)
    worker._verify_epilogue = dspark.epilogue
    step_n, step_next = Step(1, bs, dspark.stride), Step(2, bs, dspark.stride)

    def escaping_step(self, batch):
        step_n.write(self._verify_epilogue)
        epilogue = self._verify_epilogue
        return GenerationBatchResult(next_token_ids=epilogue.out_tokens_buf[:bs].reshape(-1),
                                     accept_lens=epilogue.commit_lens_buf[:bs],
                                     next_draft_input=types.SimpleNamespace(bonus_tokens=epilogue.bonus_buf[:bs]))

    # The plan wraps the real DSparkWorkerV2.forward_batch_generation with check_results; a real
    # step needs a model, so the same wrapper runs around a body that escapes.
    assert patching.applied()[-1].name == "forward_batch_generation"
    for _ in range(2):
        result = fence_boundary.check_results(escaping_step, worker, (worker, None), {})
        step_next.write(dspark.epilogue)
        assert result.accept_lens.tolist() == step_n.values["commit_lens"].tolist()
        assert result.next_draft_input.bonus_tokens.tolist() == step_n.values["bonus"].tolist()
        assert result.next_token_ids.tolist() == step_n.values["out_tokens"][:bs].reshape(-1).tolist()
        assert not shares_memory(result.accept_lens, dspark.epilogue.commit_lens_buf)
    lines = [line for line in capfd.readouterr().err.splitlines() if "boundary" in line]
    assert len(lines) == 3 and "GenerationBatchResult.accept_lens <- DsparkVerifyEpilogue.commit_lens_buf" in lines[1]
    assert "GenerationBatchResult.next_draft_input.bonus_tokens <- DsparkVerifyEpilogue.bonus_buf" in lines[2]


def test_boundary_leaves_fresh_results_alone(dspark):
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang_dsv41_adapters.folded_fence import fence_boundary

    fresh = torch.arange(4)
    result = GenerationBatchResult(accept_lens=fresh, next_draft_input=types.SimpleNamespace(bonus_tokens=fresh + 1))
    assert fence_boundary.detach_escapes(result, dspark.epilogue) == (result, [])
    assert result.accept_lens is fresh
