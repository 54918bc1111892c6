"""The fence's boundary check on the engine's own classes: any shape of result, walked without raising.

A DSpark worker step's result is handed to the check as the plan wraps
DSparkWorkerV2.forward_batch_generation, built from step N's views of a real sglang 0.5.23
DsparkVerifyEpilogue on the CPU in the shapes a reviewer might give it (a slotted
dataclass from a doctored copy of the real managers.utils, a tuple, views in lists, dicts,
msgspec structs, frozen ones, two levels down); after step N+1 rewrote the buffers the
result still holds step N everywhere, no tensor it reaches shares an epilogue buffer, and
what cannot be walked or reached is said once, never raised.
"""

from __future__ import annotations

import gc
import types

import pytest
import torch

from adapter import fence_boundary, folded_fence, runtime
from tests.conftest import Step
from tests.doctored import doctored_module

UTILS = "sglang.srt.managers.utils"
BS = 5


@pytest.fixture(autouse=True)
def fresh(verify, monkeypatch):
    """Each test starts unpatched, with no line said yet."""
    monkeypatch.setattr(fence_boundary, "_said", set())
    yield
    runtime.revert()


def fence_on(engine=None) -> runtime.Decision:
    decision = runtime.decide({folded_fence.FLAG: "1"}, engine, names=(folded_fence.NAME,))
    runtime.apply(decision)
    return decision


def epilogue_storages(epilogue) -> set:
    return {t.untyped_storage().data_ptr() for t in vars(epilogue).values() if isinstance(t, torch.Tensor) and t.numel()}


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
    assert [t for t in tensors_in(result, dspark.epilogue) if t.untyped_storage().data_ptr() in shared] == []
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

    def build(views):
        return generation_result(accept_lens=views.commit_lens, dllm_algo_state=[Unreadable(), deep])

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
