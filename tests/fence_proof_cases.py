"""Child side of test_fence_proofs' cases on another release (harness.ranks.run_ranks, one rank,
the release first on the path): the fence decided and applied as a rank does it, then the
release's own folded accept_and_finalize on the CPU, unfenced and fenced on identical state."""

from __future__ import annotations

import inspect
import types

BS, STRIDE, MAX_BS = 5, 4, 16


def folded_result_on_the_release(rank: int, world_size: int, shadow: bool) -> dict:
    """The fence's results against the engine's own, call by call; with `shadow`, an instance
    attribute shadows read_accept from the start (bonus read from correct_len's buffer)."""
    import torch

    from sglang_dsv41_adapters.folded_fence import fence_forms, holders
    from sglang_dsv41_adapters import folded_fence
    from sglang_dsv41_adapters.framework import runtime
    from sglang.srt.speculative.dspark_components import dspark_verify as verify
    from tests.conftest import Step

    extra = {}
    if "tp_sync" in inspect.signature(verify.DsparkVerifyEpilogue).parameters:  # 0.5.19 on
        from sglang.srt.speculative.spec_tp_sync import SpecTpSync

        extra["tp_sync"] = SpecTpSync(types.SimpleNamespace(world_size=1, rank_in_group=0))
    epilogue = verify.DsparkVerifyEpilogue(max_bs=MAX_BS, verify_num_draft_tokens=STRIDE, device="cpu", **extra)
    executor = object.__new__(verify.TargetVerifyExecutor)  # the folded path reads only verify_epilogue
    executor.verify_epilogue = epilogue
    ids = torch.zeros(BS, STRIDE, dtype=torch.int64)
    kwargs = dict(folded_accept=True, bs=BS, verify_ids_2d=ids, target_logits=None, draft_block=None, sampling_info=None,
                  draft_input=None, layout=None, prefix_lens=torch.zeros(BS, dtype=torch.int64), draft_tokens=ids[:, 1:])
    if shadow:
        read = epilogue.read_accept

        def swapped(bs):
            outs = read(bs)
            outs.bonus = outs.correct_len
            return outs

        epilogue.read_accept = swapped
    step_n, step_next = Step(1, BS, STRIDE), Step(2, BS, STRIDE)
    step_n.write(epilogue)
    engine = dict(holders.items(executor.accept_and_finalize(**kwargs)))
    engine = {key: value.clone() for key, value in engine.items()}
    decision = runtime.decide({folded_fence.FLAG: "1"}, names=(folded_fence.NAME,))
    runtime.apply(decision)
    form = next(p.wrapper for p in decision.plans[folded_fence.NAME].patches if p.name == "accept_and_finalize")
    buffers = {t.untyped_storage().data_ptr() for t in vars(epilogue).values() if isinstance(t, torch.Tensor) and t.numel()}
    calls = []
    for _ in range(fence_forms.PROOF_CALLS + 2):
        step_n.write(epilogue)
        fenced = executor.accept_and_finalize(**kwargs)
        step_next.write(epilogue)
        mine = dict(holders.items(fenced))
        calls.append({
            "type": type(fenced) is verify.AcceptOuts,
            "equal": mine.keys() == engine.keys() and all(
                mine[k].dtype == v.dtype and mine[k].shape == v.shape and torch.equal(mine[k], v) for k, v in engine.items()),
            "fresh": all(t.untyped_storage().data_ptr() not in buffers for t in mine.values()),
        })
    return {"form": type(form).__name__, "notes": getattr(form, "notes", None), "trusted": sorted(getattr(form, "trusted", ())),
            "off": getattr(form, "off", None), "calls": calls, "version": decision.engine}
