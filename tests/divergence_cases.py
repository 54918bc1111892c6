"""Rank code for tests/test_tp_divergence.py (run through harness.ranks.run_ranks).

Each case runs n decode steps through real broadcast sites, with a skew on rank 1 at one
site for the steps in `skewed`, once with the divergence report off and once on (in one
start-up), and returns the decision values each rank ended with, the counters, and the
report lines the rank printed.

- engine_case (sglang 0.5.23): the engine's own SpecTpSync over a real GroupCoordinator;
  the accept triple through the real `dspark_verify.build_accept_outs`, the other sites
  through `SpecTpSync.sync` as their engine callers call it.
- pack_case (sglang 0.5.18): rank0_broadcast applied, the real decision functions
  through the bindings it wraps (eager draft, accept, DFlash greedy accept, DFlash
  prefill).
"""

from __future__ import annotations

import contextlib
import inspect
import io

import torch
from tests.log_lines import untimed

BS, GAMMA, VOCAB = 4, 3, 11


def make_group(rank: int, world_size: int):
    """A real sglang GroupCoordinator over gloo, with whichever switches this release takes."""
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    wanted = dict(group_ranks=[list(range(world_size))], local_rank=rank, torch_distributed_backend="gloo",
                  group_name="tp_divergence_test")
    for name in inspect.signature(GroupCoordinator.__init__).parameters:
        if name.startswith("use_"):
            wanted[name] = False
    return GroupCoordinator(**wanted)


def _configure(environ: dict, names):
    from sglang_dsv41_adapters.framework import runtime

    decision = runtime.decide(environ, names=names)
    runtime.apply(decision)
    return decision


def _report_env(report: bool, every: int) -> dict:
    return {"DSV41_TP_DIVERGENCE": "1", "DSV41_TP_DIVERGENCE_EVERY": str(every)} if report else {}


def _run(step, n: int, report: bool):
    """n steps; the values they end with, the counters and every line printed."""
    from sglang_dsv41_adapters.tp_divergence import divergence

    divergence.reset()
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        values = [step(i) for i in range(n)]
        divergence.flush()
    lines = [line for line in untimed(printed.getvalue()) if "tp_divergence" in line]
    return {"values": values, "totals": divergence.totals() if report else {}, "lines": lines}


# ---------------------------------------------------------------- sglang 0.5.23


def engine_case(rank, world_size, n, skews, every=5):
    """skews: [(site slug or None, [skewed steps])]; every site called n times per run."""
    from sglang.srt.speculative.dspark_components.dspark_verify import build_accept_outs
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync, SpecTpSyncSite as S

    tp_sync = SpecTpSync(make_group(rank, world_size))

    def steps(slug, skewed):
        def step(i):
            skew = int(rank == 1 and i in skewed)
            drafts = []
            for j in range(GAMMA):  # draft: one sync per step, as sample_draft_block does
                tokens = torch.arange(BS) + 10 * i + j
                if slug == "dspark-draft" and j == 1:
                    tokens[2] += skew
                drafts.append(tp_sync.sync(S.DSPARK_DRAFT, tokens).tolist())
            bonus = torch.arange(BS) + 100 + i
            if slug == "dspark-accept-greedy":
                bonus[0] += skew  # one element of one of the three syncs
            outs = build_accept_outs(
                correct_len=torch.full((BS,), 2, dtype=torch.int64), bonus=bonus,
                cap_trim_lens=torch.zeros(BS, dtype=torch.int32), prefix_lens=torch.arange(BS) + 10,
                draft_tokens=torch.arange(BS * GAMMA).view(BS, GAMMA), gamma=GAMMA, verify_num_draft_tokens=GAMMA + 1,
                tp_sync=tp_sync, sync_site=S.DSPARK_ACCEPT_GREEDY)
            ids = torch.arange(BS) + 7 * i
            tp_sync.sync(S.DSPARK_TARGET, ids)
            predict = torch.arange(BS * 4).view(BS, 4) + i
            if slug == "dflash-accept-greedy":
                predict[1, :2] += skew  # two elements
            tp_sync.sync(S.DFLASH_ACCEPT_GREEDY, predict)
            return {"draft": drafts, "accept": [getattr(outs, f).tolist() for f in outs.__struct_fields__],
                    "target": ids.tolist(), "dflash": predict.tolist()}

        return step

    out = {}
    for slug, skewed in skews:
        for report in (False, True):
            decision = _configure(_report_env(report, every), names=("tp_divergence",))
            out[f"{slug}/{report}"] = _run(steps(slug, set(skewed)), n, report) | {
                "state": decision.outcomes[0].state}
    _configure({}, names=("tp_divergence",))
    return out


# ---------------------------------------------------------------- sglang 0.5.18


def pack_case(rank, world_size, n, skewed, every=5):
    """The skew: rank 1's target logits reject request 0's first draft token at the accept
    (site 8) in the `skewed` steps; every other decision is the same on every rank."""
    from tests.broadcast_cases import _bind, _head, _modules, _skewed_logits

    r, mods = _modules()
    draft, verify, dflash = mods[r.DRAFT], mods[r.VERIFY], mods[r.DFLASH_WORKER]
    _bind(rank, world_size)
    head = _head()
    vnd = GAMMA + 1
    cand = torch.stack([torch.arange(vnd) % VOCAB for _ in range(BS)])
    block = type("Block", (), {"greedy_mask": torch.ones(BS, dtype=torch.bool)})()
    skewed = set(skewed)

    def logits(skew: bool):
        tl = torch.full((BS * vnd, VOCAB), -5.0)
        for b in range(BS):
            for j in range(vnd - 1):
                tl[b * vnd + j, (j + 1) % VOCAB] = 5.0  # the target agrees with every draft token
        if skew:
            tl[0] = 0.0
            tl[0, 7] = 9.0
        return tl

    def accept(function, skew):
        return function(candidates=cand, target_logits=logits(skew), draft_block=block, sampling_info=None,
                        draft_input=None, gamma=GAMMA, verify_num_draft_tokens=vnd)

    # What rank 1's skew changes in the triple, computed with the engine function alone.
    original = inspect.unwrap(verify.accept_draft_tokens)
    expected_elements = sum(int(torch.ne(a, b).sum()) for a, b in zip(accept(original, True), accept(original, False)))

    def step(i):
        res = draft.sample_draft_block(
            base_logits=_skewed_logits(0, (BS, GAMMA, VOCAB), seed=i), anchor_tokens=torch.arange(BS),
            draft_hidden=torch.zeros(BS, GAMMA, 2), sampling_info=None, markov_head=head, device=torch.device("cpu"))
        triple = accept(verify.accept_draft_tokens, rank == 1 and i in skewed)
        predict = torch.tensor([[2, 3, 4, 9]] * BS) + i
        acc, bonus = dflash.compute_dflash_correct_drafts_and_bonus(candidates=torch.tensor([[1, 2, 3, 4]] * BS),
                                                                    target_predict=predict)
        ids = torch.arange(BS) + 3 * i
        inp = dflash.DFlashWorkerV2._make_next_draft_input_prefill(
            object.__new__(dflash.DFlashWorkerV2), bonus_tokens=ids, seq_lens=torch.ones(BS, dtype=torch.int64))
        return {"draft": res.draft_tokens.tolist(), "accept": [t.tolist() for t in triple],
                "dflash": [acc.tolist(), bonus.tolist()], "dflash_target": inp.bonus_tokens.tolist()}

    names = ("rank0_broadcast", "tp_divergence")
    out = {"expected_elements": expected_elements}
    for report in (False, True):
        decision = _configure({"DSV41_SPEC_TP_SYNC": "all"} | _report_env(report, every), names)
        out[str(report)] = _run(step, n, report) | {"states": [o.state for o in decision.outcomes]}
    _configure({}, names)
    return out


def exit_case(rank, world_size, k):
    """k diverged calls on rank 1 at one site, no report before the rank exits: the exit
    report (atexit) must print them, after the process group is gone."""
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync, SpecTpSyncSite as S

    tp_sync = SpecTpSync(make_group(rank, world_size))
    _configure(_report_env(True, 10**9), names=("tp_divergence",))
    for i in range(2 * k):
        tp_sync.sync(S.DFLASH_TARGET, torch.arange(BS) + int(rank == 1 and i % 2 == 0))
    return {"calls": 2 * k}
