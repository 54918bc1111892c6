"""Rank code for the pack's own site 31:pack-dflash-draft-greedy (tests/test_dflash_draft.py,
tests/test_tp_nccl.py, bench/dflash_draft_drift.py), spawned through harness.nccl.

Each path is the engine's own DFlash draft code, over sglang's GroupCoordinator (gloo on the
CPU, NCCL with pynccl on GPUs), with a skew on rank 1 in chosen steps that makes rank 1's own
argmax differ where the path is rank-local:
- domino: `_DominoDraftSampler.__call__` -> `domino_greedy_rollout` (0.5.20+), TP 2 vocab shards
  of the target head (all-gathered logits); rank 1's replicated projector row weights skewed.
- selector: `_SelectorDraftSampler.__call__` with the engine's `CandidateSelector` (lattice and
  walk); the candidates (gathered top-k in the engine, the same on every rank) come from a
  replicated stand-in head; rank 1's replicated hidden projection skewed.
- plain_local / plain_sharded: `DFlashWorkerV2._greedy_sample_from_vocab_parallel_head` (every
  release) on a head without shard_indices (each rank argmaxes its own logits; rank 1's
  weights skewed) and on a vocab-parallel head (shard_indices: the per-shard maxima are
  all-gathered; rank 1's shard skewed, which every rank then sees alike).
The two samplers run inside a captured CUDA graph on GPUs (the engine runs them as the draft
graph's capture hook); on the CPU each replay is an eager call. The plain head is eager in the
engine and here. Every rank records, per step, the block it holds after the call.
"""

from __future__ import annotations

import time
import types

import torch

from harness.nccl import capture, device_of, make_group, run

VOCAB, HIDDEN, BLOCK, BS = 32, 16, 4, 4
SLOTS = BLOCK - 1
CAPTURED = ("domino", "selector")
SITE_KEY = "31:pack-dflash-draft-greedy"


def _worker():
    import sglang.srt.speculative.dflash_worker_v2 as w

    return w


def _configure(environ: dict) -> dict:
    """rank0_broadcast (and tp_divergence when asked) decided and applied as every rank does."""
    from harness.doctored import DoctoredEngine
    from sglang_dsv41_adapters import rank0_broadcast as r, tp_divergence as t
    from sglang_dsv41_adapters.framework import runtime

    runtime.revert()
    decision = runtime.decide(environ, DoctoredEngine({}), names=(r.NAME, t.NAME))
    runtime.apply(decision)
    return {o.adapter: o.state.value for o in decision.outcomes}


def _seeded(seed, *shape, device):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


# ---------------------------------------------------------------- the paths

def _domino(rank, world, group, device, steps):
    """The Domino sampler over a vocab shard per rank; `skew(on)` sets rank 1's projector."""
    import torch.nn as nn

    torch.manual_seed(0)  # the same replicated modules on every rank
    shard = VOCAB // world
    embedding = nn.Embedding(VOCAB, HIDDEN).to(device)
    head = _seeded(1, VOCAB, HIDDEN, device=device)
    gru = nn.GRU(HIDDEN, HIDDEN, batch_first=True).to(device)
    proj = nn.Sequential(nn.Linear(2 * HIDDEN, HIDDEN), nn.SiLU(), nn.Linear(HIDDEN, VOCAB, bias=False)).to(device)
    sampler = _worker()._DominoDraftSampler(
        target_embedding=embedding, lm_head_weight=head[rank * shard:(rank + 1) * shard].contiguous(),
        prefix_gru=gru, embed_proj=proj, vocab_size=VOCAB, block_size=BLOCK, shift_label=True, max_bs=BS,
        candidate_pool_size=0, tp_group=group, lm_head_org_vocab_start=rank * shard, lm_head_num_org=shard,
        lm_head_num_org_padded=shard)
    own = proj[2].weight.detach().clone()
    skewed = own + _seeded(2, *own.shape, device=device) * 8
    hidden = torch.empty(BS * BLOCK, HIDDEN, device=device)
    ids = torch.zeros(BS * BLOCK, dtype=torch.int64, device=device)

    def load(step, on):
        hidden.copy_(_seeded(100 + step, BS * BLOCK, HIDDEN, device=device))
        ids.copy_(torch.arange(BS * BLOCK, device=device) % VOCAB)
        with torch.no_grad():
            proj[2].weight.copy_(skewed if on else own)

    def region():
        with torch.no_grad():
            sampler(hidden, ids)

    return load, region, lambda: sampler.out[:BS * SLOTS]


def _selector(rank, world, group, device, steps):
    from sglang.srt.models.dflash import CandidateSelector

    torch.manual_seed(0)
    selector = CandidateSelector(hidden_size=HIDDEN, vocab_size=VOCAB, state_rank=4, top_k=4).to(device)
    with torch.no_grad():
        selector.predecessor_codebook.copy_(_seeded(3, VOCAB, 4, device=device))
        selector.successor_codebook.copy_(_seeded(4, VOCAB, 4, device=device))
    head = _seeded(5, VOCAB, HIDDEN, device=device)

    def compute_candidates(hidden):  # the engine's gathered top-k: the same on every rank
        values, ids = torch.topk(hidden @ head.T, selector.top_k, dim=-1)
        return ids, values

    model = types.SimpleNamespace(candidate_selector=selector, compute_candidates=compute_candidates)
    sampler = _worker()._SelectorDraftSampler(draft_model=model, block_size=BLOCK, max_bs=BS, device=device,
                                              sampling_enabled=False)
    own = selector.hidden_projection.weight.detach().clone()
    skewed = own + _seeded(6, *own.shape, device=device) * 8
    hidden = torch.empty(BS * BLOCK, HIDDEN, device=device)
    ids = torch.zeros(BS * BLOCK, dtype=torch.int64, device=device)

    def load(step, on):
        hidden.copy_(_seeded(200 + step, BS * BLOCK, HIDDEN, device=device))
        ids.copy_(torch.arange(BS * BLOCK, device=device) % VOCAB)
        with torch.no_grad():
            selector.hidden_projection.weight.copy_(skewed if on else own)

    def region():
        with torch.no_grad():
            sampler(hidden, ids)

    return load, region, lambda: sampler.out[:BS * SLOTS]


class _ShardIndices:
    def __init__(self, start, count):
        self.num_org_elements = self.num_org_elements_padded = count
        self.num_added_elements, self.org_vocab_start_index, self.added_vocab_start_index = 0, start, 0


def _plain(rank, world, group, device, steps, sharded):
    w = _worker()
    shard = VOCAB // world
    full = _seeded(7, VOCAB, HIDDEN, device=device)
    own = full[rank * shard:(rank + 1) * shard].contiguous() if sharded else full
    skewed = own + _seeded(8, *own.shape, device=device) * 8
    head = types.SimpleNamespace(weight=own.clone())
    if sharded:
        head.shard_indices = _ShardIndices(rank * shard, shard)
    me = types.SimpleNamespace(**{f"_draft_greedy_{n}": None for n in (
        "local_max_buf", "local_arg_buf", "gathered_max_buf", "gathered_ids_buf", "best_rank_buf",
        "rank_index_buf", "selected_ids_buf")}, **{f"_draft_greedy_{n}": 0 for n in (
        "local_cap", "gather_cap", "index_cap")})
    hidden = torch.empty(BS * SLOTS, HIDDEN, device=device)
    out = {}

    def load(step, on):
        hidden.copy_(_seeded(300 + step, BS * SLOTS, HIDDEN, device=device))
        head.weight.copy_(skewed if on else own)

    def region():
        out["block"] = w.DFlashWorkerV2._greedy_sample_from_vocab_parallel_head(me, hidden_states=hidden, lm_head=head)

    return load, region, lambda: out["block"]


PATHS = {"domino": _domino, "selector": _selector,
         "plain_local": lambda *a: _plain(*a, sharded=False), "plain_sharded": lambda *a: _plain(*a, sharded=True)}


# ---------------------------------------------------------------- the case

class _Parallel:
    """The TP group as the plain head reads it (get_parallel().tp_group from 0.5.19,
    get_tp_group() before), for the duration."""

    def __init__(self, group):
        parallel = types.SimpleNamespace(tp_group=group, tp_rank=group.rank_in_group)
        self.readers = {"get_parallel": lambda: parallel, "get_tp_group": lambda: group}

    def __enter__(self):
        w = _worker()
        self.before = {name: getattr(w, name) for name in self.readers if hasattr(w, name)}
        for name in self.before:
            setattr(w, name, self.readers[name])

    def __exit__(self, *exc):
        for name, reader in self.before.items():
            setattr(_worker(), name, reader)


def draft_case(rank, world, nccl, n, skewed, paths=tuple(PATHS), variants=("off", "on", "on_report"), timing=0,
               capture_samplers=True):
    """Per path and variant: the steps after which this rank held another block than rank 0,
    collectives the pack issued at the site, divergence totals (on_report), and, with
    `timing`, the median seconds per step of the path and of a bare broadcast of its block
    (`capture_samplers` False: the samplers run eagerly on GPUs too)."""
    import torch._dynamo

    from sglang_dsv41_adapters.spectpsync import broadcast as pack
    from sglang_dsv41_adapters.spectpsync.sites import Site
    from sglang_dsv41_adapters.tp_divergence import divergence

    torch._dynamo.config.disable = True  # the selector's torch.compile'd helpers run eagerly (no inductor here)
    skewed = frozenset(skewed)
    group, kind = make_group(rank, world, nccl)
    if not nccl:  # sglang registers its all-gather op for CUDA only: on the CPU, the coordinator's inner path
        group.all_gather_into_tensor = group._all_gather_into_tensor
    device = device_of(group, nccl)
    import sglang

    out = {"group": kind, "sglang": sglang.__version__, "paths": {}}
    environs = {"off": {}, "on": {"DSV41_SPEC_TP_SYNC": "pack-dflash-draft-greedy"},
                "on_report": {"DSV41_SPEC_TP_SYNC": "pack-dflash-draft-greedy", "DSV41_TP_DIVERGENCE": "1",
                              "DSV41_TP_DIVERGENCE_EVERY": "100000"}}
    try:
        with _Parallel(group):
            for name in paths:
                out["paths"][name] = {}
                for variant in variants:
                    captured = nccl and capture_samplers and name in CAPTURED
                    out["paths"][name][variant] = _run(rank, world, group, device, nccl, captured, name,
                                                       environs[variant], n, skewed, timing, pack, divergence, Site)
    finally:
        pack.reset()
        divergence.reset()
        _configure({})
    return out


def _run(rank, world, group, device, nccl, captured, name, environ, n, skewed, timing, pack, divergence, Site):
    states = _configure(environ)
    pack.reset()
    pack.bind_group(pack.DFLASH, group)  # what DFlashWorkerV2.__init__ records through the adapter
    load, region, block = PATHS[name](rank, world, group, device, n)
    load(0, False)
    region()  # the warm-up before capture (makes the divergence counters)
    graph = capture(group, region, nccl) if captured else None
    at_capture = pack.COUNTS[Site.PACK_DFLASH_DRAFT_GREEDY]
    divergence.reset()
    rows = []
    for step in range(n):
        load(step, rank == 1 and step in skewed)
        run(graph, region)
        rows.append(block().clone())
    if nccl:
        torch.cuda.synchronize()
    history = torch.stack(rows)
    zero = history.clone()
    group.broadcast(zero, src=0)
    collectives = pack.COUNTS[Site.PACK_DFLASH_DRAFT_GREEDY] - at_capture
    totals = divergence.totals() if environ.get("DSV41_TP_DIVERGENCE") else {}
    moved = []  # the skewed steps again with no skew anywhere: where this rank's block moved
    for step in sorted(skewed):
        load(step, False)
        run(graph, region)
        if not torch.equal(block().cpu(), history[step].cpu()):
            moved.append(step)
    result = {"states": states, "captured": graph is not None, "collectives_at_capture": at_capture,
              "collectives": collectives, "skew_moved": moved,
              "steps_off": [i for i in range(n) if not torch.equal(history[i], zero[i])],
              "distinct_blocks": len({tuple(r.tolist()) for r in history}),
              "totals": totals}
    if timing:
        result["seconds"] = _time(group, graph, region, block, timing, nccl)
    return result


def _time(group, graph, region, block, repeats, nccl):
    """Median seconds per step: the path (replayed when captured) and a bare broadcast of its block."""
    import torch.distributed as dist

    def median(action):
        times = []
        for _ in range(repeats):
            if nccl:
                torch.cuda.synchronize()
            dist.barrier()  # the ranks start each step together (the default gloo group): no wait for a late one
            start = time.perf_counter()
            action()
            if nccl:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    tensor = block().clone()
    return {"path": median(lambda: run(graph, region)), "bare_broadcast": median(lambda: group.broadcast(tensor, src=0))}

