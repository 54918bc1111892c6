"""Rank code for tests/test_rank0_broadcast.py (run through harness.ranks.run_ranks on 0.5.18).

Every site that runs on the CPU is driven through the real 0.5.18 engine function
(through the consumer binding the adapter replaces), with a skew on rank 1: other
logits, another random draw, an accept length off by one. Each case returns the
decision values it ended with, so the test can compare ranks.
"""

from __future__ import annotations

import types

import torch

VOCAB, BS = 11, 4


def make_group(rank: int, world_size: int):
    """A real sglang GroupCoordinator over gloo (pynccl and friends off: CPU only)."""
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    return GroupCoordinator(
        group_ranks=[list(range(world_size))], local_rank=rank, torch_distributed_backend="gloo",
        use_pynccl=False, use_pymscclpp=False, use_custom_allreduce=False,
        use_torch_symm_mem_all_reduce=False, use_hpu_communicator=False, use_xpu_communicator=False,
        use_npu_communicator=False, group_name="rank0_broadcast_test",
    )


def _modules():
    import importlib

    from sglang_dsv41_adapters import rank0_broadcast as r
    from sglang_dsv41_adapters.spectpsync import engine_class

    return r, {name: importlib.import_module(name) for name, _ in r.TARGETS if name != engine_class.MODULE}


def _configure(value):
    """Select `value` (None = flag unset) and bring this process in line with it, as the
    launcher and every rank do; returns the decision."""
    from sglang_dsv41_adapters.framework import runtime

    r, _ = _modules()
    decision = runtime.decide({} if value is None else {r.FLAG: value}, names=(r.NAME,))
    runtime.apply(decision)
    return decision


def wrapper_of(decision, where):
    """The wrapper the decision put on a binding (None when the binding is not patched):
    for the sites that cannot run on the CPU, it runs around a CPU stand-in."""
    plan = decision.plans.get("rank0_broadcast")
    return next((p.wrapper for p in plan.patches if p.where == where), None) if plan else None


def _head():
    from sglang.srt.models.dspark import VanillaMarkov

    torch.manual_seed(0)  # same weights on every rank
    return VanillaMarkov(vocab_size=VOCAB, markov_rank=3)


def _skewed_logits(rank, shape, seed=1):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, generator=g)
    if rank == 1:  # the skew: other logits on rank 1
        logits = logits + torch.randn(*shape, generator=torch.Generator().manual_seed(99)) * 3
    return logits


def run_sites(rank, world_size, decision, gamma=3):
    """One pass over every CPU site; returns {site: values this rank holds}."""
    r, mods = _modules()
    draft, sampler_mod, verify = mods[r.DRAFT], mods[r.DRAFT_SAMPLER], mods[r.VERIFY]
    dflash = mods[r.DFLASH_WORKER]
    out = {}
    head = _head()
    hidden = torch.zeros(BS, gamma, 2)
    anchor = torch.arange(BS)

    # DSpark eager draft, greedy (argmax per step): different logits on rank 1.
    res = draft.sample_draft_block(
        base_logits=_skewed_logits(rank, (BS, gamma, VOCAB)), anchor_tokens=anchor, draft_hidden=hidden,
        sampling_info=None, markov_head=head, device=torch.device("cpu"))
    out["draft_greedy"] = res.draft_tokens.tolist()

    # DSpark eager draft, multinomial: same logits, another random draw on rank 1.
    torch.manual_seed(1000 + rank)
    info = types.SimpleNamespace(is_all_greedy=False, temperatures=torch.ones(BS, 1),
                                 top_ks=torch.full((BS,), 5))
    res = draft.sample_draft_block(
        base_logits=_skewed_logits(0, (BS, gamma, VOCAB)), anchor_tokens=anchor, draft_hidden=hidden,
        sampling_info=info, markov_head=head, device=torch.device("cpu"))
    out["draft_multinomial"] = res.draft_tokens.tolist()

    # DSpark graph-folded draft: the real DsparkDraftSampler.__call__, run eagerly on the
    # CPU (on the GPU it runs inside draft graph capture), greedy and folded sampling.
    for folded in (False, True):
        torch.manual_seed(2000 + rank)
        model = types.SimpleNamespace(markov_head=head, lm_head=types.SimpleNamespace(
            org_vocab_size=VOCAB, weight=torch.zeros(1)))
        logits = _skewed_logits(rank if not folded else 0, (BS * gamma, VOCAB), seed=3)
        model.compute_base_logits = lambda h, logits=logits: (logits, None)
        s = sampler_mod.DsparkDraftSampler(model=model, gamma=gamma, max_bs=BS, device="cpu",
                                           folded_sampling=folded)
        if folded:
            s.stage_sampling_params(bs=BS, sampling_info=types.SimpleNamespace(
                temperatures=torch.ones(BS), top_ks=torch.full((BS,), 5)))
        s(torch.zeros(BS * gamma, 2), torch.arange(BS * gamma) % VOCAB)
        out["graph_sample" if folded else "graph_greedy"] = s.out.tolist()

    # DSpark eager accept triple (AcceptGreedy on the CPU): rank 1's target logits differ,
    # so its accept length is off.
    vnd = gamma + 1
    cand = torch.stack([torch.arange(vnd) % VOCAB for _ in range(BS)])
    tl = torch.full((BS * vnd, VOCAB), -5.0)
    for b in range(BS):
        for j in range(vnd - 1):
            tl[b * vnd + j, (j + 1) % VOCAB] = 5.0  # target agrees with every draft token
    if rank == 1:
        tl[0 * vnd + 0] = 0.0
        tl[0 * vnd + 0, 7] = 9.0  # rank 1 rejects request 0's first draft token
    block = types.SimpleNamespace(greedy_mask=torch.ones(BS, dtype=torch.bool))
    triple = verify.accept_draft_tokens(candidates=cand, target_logits=tl, draft_block=block, sampling_info=None,
                                        draft_input=None, gamma=gamma, verify_num_draft_tokens=vnd)
    out["accept_greedy"] = [t.tolist() for t in triple]
    out["accept_dtypes"] = [str(t.dtype) for t in triple]

    # DSpark captured accept: accept_greedy_triton runs only inside verify-graph capture
    # on the GPU; here the adapter's wrapper on that binding runs around the CPU twin
    # (AcceptGreedy.torch, same math) with the same skew.
    from sglang.kernels.ops.speculative.dspark.dspark_accept import AcceptGreedy

    wrapper = wrapper_of(decision, "dspark_verify.accept_greedy_triton")
    kwargs = dict(candidates=cand, target_logits=tl, verify_num_draft_tokens=vnd)
    triple = wrapper(AcceptGreedy.torch, None, (), kwargs) if wrapper else AcceptGreedy.torch(**kwargs)
    out["accept_graph"] = [t.tolist() for t in triple]

    # DSpark prefill tokens: the wrapper on DSparkWorkerV2._forward_prefill around a
    # prefill that samples other ids on rank 1 (int32 ids, so the real
    # make_next_draft_input copies them with .to(int64): both tensors must be fixed).
    worker_cls = mods[r.DSPARK_WORKER].DSparkWorkerV2

    def prefill(batch, on_publish):
        ids = torch.tensor([5, 6, 7, 8], dtype=torch.int32) + (rank == 1)
        return types.SimpleNamespace(next_token_ids=ids, next_draft_input=draft.make_next_draft_input(
            bonus_tokens=ids, new_seq_lens=torch.ones(BS, dtype=torch.int64)))

    batch = types.SimpleNamespace(forward_mode=types.SimpleNamespace(is_idle=lambda: False))
    wrapper = wrapper_of(decision, "DSparkWorkerV2._forward_prefill")
    res = wrapper(prefill, None, (batch, None), {}) if wrapper else prefill(batch, None)
    out["dspark_target"] = [res.next_token_ids.tolist(), res.next_draft_input.bonus_tokens.tolist()]

    # DFlash greedy accept: real compute_dflash_correct_drafts_and_bonus through the
    # dflash_worker_v2 binding; rank 1's target argmax differs.
    cand = torch.tensor([[1, 2, 3, 4]] * BS)
    predict = torch.tensor([[2, 3, 4, 9]] * BS)
    if rank == 1:
        predict[0, 1] = 10
    acc, bonus = dflash.compute_dflash_correct_drafts_and_bonus(candidates=cand, target_predict=predict)
    out["dflash_greedy"] = [acc.tolist(), bonus.tolist()]

    # DFlash greedy, Triton accept failing on rank 1 only and falling back to the eager
    # one with the same target_predict: one broadcast on every rank, no hang.
    predict = torch.tensor([[2, 3, 4, 9]] * BS)
    if rank == 1:
        predict[1, 0] = 10
    triton = dflash._compute_dflash_accept_bonus_triton_unchecked
    wrapper = wrapper_of(decision, "dflash_worker_v2._compute_dflash_accept_bonus_triton_unchecked")
    if rank == 0 and wrapper:
        wrapper(lambda **kw: None, None, (), dict(candidates=cand, target_top1=predict))
        acc = torch.tensor([3, 3, 3, 3])
    else:
        try:
            triton(candidates=cand, target_top1=predict)  # real Triton kernel: fails on the CPU
        except Exception:
            pass
        acc, _ = dflash.compute_dflash_correct_drafts_and_bonus(candidates=cand, target_predict=predict)
    out["dflash_greedy_fallback"] = [predict.tolist(), acc.tolist()]

    # DFlash sampled accept: the real function needs sgl_kernel (CUDA); the adapter's
    # wrapper on that binding runs around a draw that differs on rank 1.
    def sampled(**kw):
        torch.manual_seed(3000 + rank)
        return torch.randint(0, 4, (BS,), dtype=torch.int32), torch.randint(0, VOCAB, (BS,))

    wrapper = wrapper_of(decision, "dflash_worker_v2.compute_dflash_sampling_correct_drafts_and_bonus")
    acc, bonus = wrapper(sampled, None, (), {}) if wrapper else sampled()
    out["dflash_accept_sample"] = [acc.tolist(), bonus.tolist()]

    # DFlash prefill: the real DFlashWorkerV2._make_next_draft_input_prefill (uses no state).
    ids = torch.tensor([4, 5, 6, 7]) + (rank == 1)
    inp = dflash.DFlashWorkerV2._make_next_draft_input_prefill(
        object.__new__(dflash.DFlashWorkerV2), bonus_tokens=ids, seq_lens=torch.ones(BS, dtype=torch.int64))
    out["dflash_target"] = [ids.tolist(), inp.bonus_tokens.tolist()]
    return out


def _bind(rank, world_size):
    from sglang_dsv41_adapters.spectpsync.broadcast import DFLASH, DSPARK, bind_group

    group = make_group(rank, world_size)
    bind_group(DSPARK, group)
    bind_group(DFLASH, group)


def _by_slug(counts) -> dict:
    return {site.slug: n for site, n in counts.items()}


def sites_case(rank, world_size, configs):
    """For each flag value in `configs` (None = unset): apply accordingly, run every
    site, and return the values plus the collectives issued per site."""
    from sglang_dsv41_adapters.spectpsync.broadcast import COUNTS

    _bind(rank, world_size)
    results = {}
    for value in configs:
        decision = _configure(value)
        COUNTS.clear()
        values = run_sites(rank, world_size, decision)
        results[str(value)] = {"values": values, "counts": _by_slug(COUNTS)}
    _configure(None)
    return results


def count_case(rank, world_size, gammas):
    """Collectives per decode step, by site, with every site on: one eager draft block,
    the eager accept and the captured accept wrapper, for each gamma."""
    from sglang_dsv41_adapters.spectpsync.broadcast import COUNTS

    _bind(rank, world_size)
    decision = _configure("all")
    counts = {}
    for gamma in gammas:
        COUNTS.clear()
        run_sites(rank, world_size, decision, gamma=gamma)
        counts[str(gamma)] = _by_slug(COUNTS)
    _configure(None)
    return counts


def group_rule_case(rank, world_size):
    """The recorder on the worker __init__ picks attn-TP under DP attention, else TP,
    before the real __init__ runs (which fails here, on purpose: no model)."""
    import sglang.srt.runtime_context as rc

    from sglang_dsv41_adapters.spectpsync.broadcast import group_of

    r, mods = _modules()
    _configure("all")
    tp, attn = object(), object()
    picked = {}
    for dp in (False, True):
        # the engine's own runtime context (no configuration published: no enable_dp_attention
        # there, as on 0.5.16 - 0.5.17 at all); DP attention from the worker's server arguments
        with rc.get_parallel().override(tp_group=tp, attn_tp_group=attn):
            for family, cls in (("dspark", mods[r.DSPARK_WORKER].DSparkWorkerV2),
                                ("dflash", mods[r.DFLASH_WORKER].DFlashWorkerV2)):
                try:
                    cls(types.SimpleNamespace(enable_dp_attention=dp), 0, None, 0, None)
                except Exception:
                    pass
                group = group_of(family)
                picked[f"{family}-dp{int(dp)}"] = "attn" if group is attn else "tp" if group is tp else "none"
    _configure(None)
    return picked


def install_case(rank, world_size):
    """Bindings, idempotence and narrowing on 0.5.18 (one process is enough)."""
    from sglang_dsv41_adapters.framework import patching, runtime

    r, mods = _modules()
    d, s, v = mods[r.DRAFT], mods[r.DRAFT_SAMPLER], mods[r.VERIFY]
    w, f = mods[r.DSPARK_WORKER], mods[r.DFLASH_WORKER]
    bindings = {
        "dspark_draft.sample_draft_block": (d, "sample_draft_block"),
        "dspark_draft_sampler.greedy_step_sampler": (s, "greedy_step_sampler"),
        "dspark_draft_sampler.SampleStepTokens": (s, "SampleStepTokens"),
        "dspark_verify.accept_draft_tokens": (v, "accept_draft_tokens"),
        "dspark_verify.accept_greedy_triton": (v, "accept_greedy_triton"),
        "DSparkWorkerV2._forward_prefill": (w.DSparkWorkerV2, "_forward_prefill"),
        "DSparkWorkerV2.__init__": (w.DSparkWorkerV2, "__init__"),
        "DFlashWorkerV2.__init__": (f.DFlashWorkerV2, "__init__"),
        "DFlashWorkerV2._make_next_draft_input_prefill": (f.DFlashWorkerV2, "_make_next_draft_input_prefill"),
        "dflash_worker_v2.compute_dflash_sampling_correct_drafts_and_bonus":
            (f, "compute_dflash_sampling_correct_drafts_and_bonus"),
        "dflash_worker_v2.compute_dflash_correct_drafts_and_bonus": (f, "compute_dflash_correct_drafts_and_bonus"),
        "dflash_worker_v2._compute_dflash_accept_bonus_triton_unchecked":
            (f, "_compute_dflash_accept_bonus_triton_unchecked"),
    }
    originals = {name: vars(owner)[attr] for name, (owner, attr) in bindings.items()}

    def replaced():
        """Each binding: replaced once over its original (True), or untouched (False)."""
        out = {}
        for name, (owner, attr) in bindings.items():
            current = vars(owner)[attr]
            out[name] = current is not originals[name] and current.__wrapped__ is originals[name]
            assert current is originals[name] or out[name], f"{name} is wrapped more than once"
        return out

    report = {}
    decision = _configure("all")
    _configure("all")  # a second time: wraps once
    report["bindings"] = replaced()
    report["registry"] = sorted(f"{getattr(x.owner, '__name__', '')}.{x.name}" for x in patching.applied())
    # Shared helpers stay untouched (the rank-0-only observability caller must not broadcast).
    import sglang.srt.speculative.dflash_utils as du
    from sglang.srt.speculative.dspark_components import dspark_observability as obs
    report["shared_untouched"] = [
        du.compute_dflash_correct_drafts_and_bonus is originals["dflash_worker_v2.compute_dflash_correct_drafts_and_bonus"],
        obs.compute_dflash_correct_drafts_and_bonus is originals["dflash_worker_v2.compute_dflash_correct_drafts_and_bonus"],
    ]
    report["outcome"] = [decision.outcomes[0].state, decision.outcomes[0].reason]
    narrowed = _configure("dspark-target")
    report["only_target"] = sorted(p.where for p in narrowed.plans[r.NAME].patches)
    report["after_narrowing"] = replaced()
    _configure(None)
    report["after_revert"] = replaced()
    report["decide"] = {value: runtime.decide({r.FLAG: value}, names=(r.NAME,)).outcomes[0].state
                        for value in ("all", "off", "0", "", "init")}
    report["decide_unset"] = runtime.decide({}, names=(r.NAME,)).outcomes[0].state
    return report


def doctored_case(rank, world_size, cases):
    """The outcome on the real 0.5.18 engine with one module doctored (one string
    replaced), per case: a harness.doctored.Drift given as (module, old, new, symbol)."""
    from sglang_dsv41_adapters import rank0_broadcast as r
    from harness.doctored import Drift

    out = []
    for case in cases:
        outcome = Drift(*case).outcome(r, "all")
        out.append({"state": outcome.state, "reason": outcome.reason})
    return out


def main_case(rank, world_size, configs, gammas=(), doctored=(), extras=True):
    """Everything one set of ranks checks, in one start-up (each 0.5.18 rank spends
    ~10 s importing): per-config site values, collective counts, the group rule, the
    bindings, and the doctored-copy refusals."""
    import time

    t0 = time.time()
    out = {"sites": sites_case(rank, world_size, configs)}
    if gammas:
        out["counts"] = count_case(rank, world_size, gammas)
    if extras:
        out["group_rule"] = group_rule_case(rank, world_size)
        out["install"] = install_case(rank, world_size)
        out["packing"] = packing_case(rank, world_size)
    if doctored:
        out["doctored"] = doctored_case(rank, world_size, doctored)
    out["seconds"] = time.time() - t0
    return out


def packing_case(rank, world_size):
    """The pack's broadcast() of several tensors in one collective: mixed dtypes and shapes,
    one of them a view of a larger buffer; rank 1 starts from other values."""
    from sglang_dsv41_adapters.spectpsync.broadcast import COUNTS, DSPARK, broadcast
    from sglang_dsv41_adapters.spectpsync.sites import Site

    _bind(rank, world_size)
    shift = 100 * rank
    buffer = torch.arange(10, dtype=torch.int64) + shift
    tensors = (torch.arange(5, dtype=torch.int32) + shift, torch.arange(5, dtype=torch.int64) * 7 + shift,
               torch.tensor([[True, rank == 1, False]]), buffer[2:6], torch.tensor(3.5 + rank, dtype=torch.float16))
    before = [t.clone() for t in tensors]
    COUNTS.clear()
    out = broadcast(DSPARK, Site.DSPARK_ACCEPT_GRAPH, *tensors)
    return {"values": [t.tolist() for t in out], "dtypes": [str(t.dtype) for t in out],
            "shapes": [list(t.shape) for t in out], "same_object": [a is b for a, b in zip(out, tensors)],
            "originals_kept": [torch.equal(a, b) for a, b in zip(tensors, before)],
            "buffer": buffer.tolist(), "counts": _by_slug(COUNTS)}
