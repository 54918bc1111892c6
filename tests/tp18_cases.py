"""Rank code for tests/test_tp_nccl.py's sglang 0.5.18 case: the engine's
own graph-folded draft sampling and captured accept, over its own GroupCoordinator, captured
in one CUDA graph inside the coordinator's graph_capture() context, with the rank-0
broadcast installed through the runtime (DSV41_SPEC_TP_SYNC=all) or not (flag unset).

The ranks are spawned by harness.nccl.spawn_ranks with 0.5.18 first on sys.path.
One region holds what the engine runs inside its draft and verify graphs:
  - DsparkDraftSampler.__call__ greedy (folded_sampling=False: greedy_step_sampler) and
    folded (SampleStepTokens: greedy rows and Gumbel-sampled rows, same seed on every rank),
    the folded one writing into the epilogue's draft_tokens_buf as the engine aliases it;
  - DsparkVerifyEpilogue._accept over those drafts (ragged verify lens), which calls the
    hooked accept_greedy_triton binding, then finalize and out-token building.
Rank 1 adds `skew * bias` to the draft and target logits (skew: a device scalar, 1 in the
skewed replays): its drafts become token SKEW_DRAFT and its target predicts SKEW_TARGET,
so its drafts and accept triple differ from rank 0's unless they are broadcast. After each
replay the region appends what the engine keeps (the samplers' `out`, the epilogue's
accept buffers) to a device history; each rank reports the replays after which it held
something other than rank 0's values (rank 0's history without the adapter, broadcast over
the gloo default group after the replays).

On the CPU (gloo) every "replay" is an eager call, and the three Triton-only launches under
_accept (scatter_compact_to_strided_into, the bonus gather in accept_greedy_triton,
finalize_accept_lens_triton) are swapped for the engine's own torch reference paths
(CPU_TWINS); the hooked accept_greedy_triton itself runs for real. Only the GPU covers
the capture, the Triton kernels, NCCL and graph replays.
"""

from __future__ import annotations

import contextlib
import types

import torch

GAMMA, VOCAB, HIDDEN, BS = 3, 64, 8, 8
STRIDE = GAMMA + 1
SKEW_DRAFT, SKEW_TARGET = 1, 2  # tokens rank 1's skew pushes to the top; rank 0 never picks them
SKEW, AGREE, NEVER = 100.0, 20.0, -30.0
SEED = 1234
VARIANTS = {"on": "all", "off": None}  # DSV41_SPEC_TP_SYNC per variant (None: unset); off last, after a revert
BINDINGS = (("dspark_draft_sampler", "greedy_step_sampler"), ("dspark_draft_sampler", "SampleStepTokens"),
            ("dspark_verify", "accept_greedy_triton"))


def _configure(value):
    """The rank-0 broadcast set to `value` (None: unset) through the runtime, as every rank does."""
    from sglang_dsv41_adapters.rank0_broadcast import before_0_5_19 as r
    from harness.nccl import switch

    return switch(r, {} if value is None else {r.FLAG: value})


@contextlib.contextmanager
def cpu_twins(nccl: bool):
    """On the CPU: the Triton-only launches under DsparkVerifyEpilogue._accept replaced by the
    engine's torch reference paths, restored afterwards. On GPUs: nothing replaced."""
    if nccl:
        yield
        return
    from unittest import mock

    from sglang.kernels.ops.speculative.dspark import dspark_accept as da
    from sglang.kernels.ops.speculative.dspark import dspark_verify_window as dw
    from sglang.srt.speculative.dspark_components import dspark_verify as dv

    def scatter_into(*, compact, verify_lens, out, stride, fill_value):
        layout = types.SimpleNamespace(verify_lens=verify_lens, graph_num_tokens=compact.shape[0])
        return out.copy_(dw.scatter_compact_to_strided(compact=compact, layout=layout, fill_value=fill_value,
                                                       verify_num_draft_tokens=stride))

    def gather_bonus(*, table, idx):  # accept_greedy's own torch line for the bonus
        return table[torch.arange(table.shape[0]), idx.to(torch.long)].to(torch.int64)

    with mock.patch.object(dv, "scatter_compact_to_strided_into", scatter_into), \
            mock.patch.object(dv, "finalize_accept_lens_triton", da.FinalizeAcceptLens.torch), \
            mock.patch.object(da, "gather_row_bonus_triton", gather_bonus):
        yield


def _inputs(device):
    """Static inputs, identical on every rank (generated on the CPU from fixed seeds)."""
    g = torch.Generator().manual_seed(7)
    draft_base = torch.randn(BS * GAMMA, VOCAB, generator=g) * 2
    target_base = torch.randn(BS, STRIDE, VOCAB, generator=g) * 2
    for base in (draft_base, target_base):
        base[..., SKEW_DRAFT] = NEVER
        base[..., SKEW_TARGET] = NEVER
    draft_bias, target_bias = torch.zeros_like(draft_base), torch.zeros_like(target_base)
    draft_bias[..., SKEW_DRAFT] = SKEW
    target_bias[..., SKEW_TARGET] = SKEW
    verify_lens = STRIDE - torch.arange(BS) % 3  # ragged: 4, 3, 2, ...
    compact = torch.cat([torch.arange(int(n)) + row * STRIDE for row, n in enumerate(verify_lens)])
    t = dict(draft_base=draft_base, target_base=target_base, draft_bias=draft_bias, target_bias=target_bias,
             verify_lens=verify_lens, compact=compact,
             anchors=(torch.arange(BS * GAMMA) * 5 + 3) % VOCAB, seq_lens=100 + torch.arange(BS),
             top_ks=torch.where(torch.arange(BS) % 2 == 0, 1, 5))  # odd rows sampled
    return {k: v.to(device) for k, v in t.items()}


def _engine_objects(device, x, skew):
    """0.5.18's own sampler and epilogue objects, over a stand-in draft model whose base
    logits carry the skew (the real markov head; compute_base_logits would need a model)."""
    from sglang.srt.models.dspark import VanillaMarkov
    from sglang.srt.speculative.dspark_components import dspark_draft_sampler as ds
    from sglang.srt.speculative.dspark_components import dspark_verify as dv

    torch.manual_seed(0)  # same markov weights on every rank
    head = VanillaMarkov(vocab_size=VOCAB, markov_rank=4).to(device)
    model = types.SimpleNamespace(
        markov_head=head, lm_head=types.SimpleNamespace(org_vocab_size=VOCAB, weight=torch.zeros(1, device=device)),
        compute_base_logits=lambda hidden: (x["draft_base"] + skew * x["draft_bias"], None))
    epilogue = dv.DsparkVerifyEpilogue(max_bs=BS, verify_num_draft_tokens=STRIDE, device=device)
    epilogue.strided_logits = torch.zeros(BS * STRIDE, VOCAB, device=device)
    epilogue.begin_step(x["verify_lens"], armed=False)
    greedy = ds.DsparkDraftSampler(model=model, gamma=GAMMA, max_bs=BS, device=device, folded_sampling=False)
    folded = ds.DsparkDraftSampler(model=model, gamma=GAMMA, max_bs=BS, device=device,
                                   out=epilogue.draft_tokens_buf, folded_sampling=True)
    folded.stage_sampling_params(bs=BS, sampling_info=types.SimpleNamespace(
        temperatures=torch.ones(BS, 1, device=device), top_ks=x["top_ks"]))
    return greedy, folded, epilogue


def _fields(greedy, folded, epilogue):
    """What the engine keeps from one step, by field (each flattened to int64)."""
    e = epilogue
    return {
        "draft_greedy": [greedy.out],
        "draft_folded": [folded.out],
        "accept": [e.correct_len_buf[:BS], e.bonus_buf[:BS], e.cap_trim_lens_buf[:BS], e.commit_lens_buf[:BS],
                   e.new_seq_lens_buf[:BS], e.out_tokens_buf[:BS]],
    }


def _wrapped(originals) -> dict:
    import importlib

    from sglang_dsv41_adapters.rank0_broadcast import before_0_5_19 as r

    out = {}
    for module, name in BINDINGS:
        owner = importlib.import_module(f"{r.PACKAGE}.{module}")
        out[f"{module}.{name}"] = vars(owner)[name] is not originals[(module, name)]
    return out


def _variant(rank, group, nccl, device, n, skewed, originals):
    """One capture of the region and n replays under the current decision."""
    from sglang_dsv41_adapters.spectpsync.broadcast import COUNTS
    from harness.nccl import capture
    from tests.tp_nccl_cases import _replays

    skew = torch.zeros((), device=device)
    x = _inputs(device)
    hidden = torch.zeros(BS * GAMMA, HIDDEN, device=device)
    greedy, folded, epilogue = _engine_objects(device, x, skew)
    target = epilogue.strided_logits.view(BS, STRIDE, VOCAB)
    agree = torch.full((BS, GAMMA, 1), AGREE, device=device)
    candidates = torch.zeros(BS, STRIDE, dtype=torch.int64, device=device)
    fields = _fields(greedy, folded, epilogue)
    width = sum(t.numel() for ts in fields.values() for t in ts)
    history = torch.zeros(n, width, dtype=torch.int64, device=device)
    step = torch.zeros(1, dtype=torch.int64, device=device)
    python_calls = [0]

    def region():  # as the draft graph's tail hook and the verify graph's epilogue run it
        python_calls[0] += 1
        greedy(hidden, x["anchors"])
        folded(hidden, x["anchors"])
        drafts = folded.out.view(BS, GAMMA)  # the epilogue's draft_tokens_buf
        candidates[:, 0].copy_(x["anchors"].view(BS, GAMMA)[:, 0])
        candidates[:, 1:].copy_(drafts)
        target.copy_(x["target_base"] + skew * x["target_bias"])
        target[:, :GAMMA].scatter_add_(2, drafts.unsqueeze(-1), agree)  # the target agrees with the drafts
        input_ids = candidates.view(-1)[x["compact"]]  # compact verify ids, as the ragged verify batch holds them
        epilogue._accept(input_ids, x["seq_lens"], epilogue.verify_lens_buf[:BS], BS)
        row = torch.cat([t.reshape(-1).to(torch.int64) for ts in fields.values() for t in ts])
        history.index_copy_(0, step, row.unsqueeze(0))
        step.add_(1)

    COUNTS.clear()
    with cpu_twins(nccl):
        if not nccl:
            region()  # the warm-up capture() does on the GPU
        graph = capture(group, region, nccl)
        captures = python_calls[0]
        counts = {site.slug: n for site, n in COUNTS.items()}
        step.zero_()
        torch.manual_seed(SEED)  # every rank and variant replays the same random draws
        _replays(n, skewed, rank, skew, graph, region, nccl)
    spans, start = {}, 0
    for name, ts in fields.items():
        size = sum(t.numel() for t in ts)
        spans[name], start = (start, start + size), start + size
    return history.cpu(), spans, {
        "captured": graph is not None, "replays": int(step.item()), "calls_before_replays": captures,
        "python_calls_in_replays": python_calls[0] - captures, "collectives_at_capture": counts,
        "wrapped": _wrapped(originals)}


def release18_case(rank, world, nccl, n, skewed):
    """Per variant (adapter on, then off): the replays after which this rank's drafts or
    accept values differ from rank 0's (without the adapter), per field."""
    import importlib

    import sglang
    import torch.distributed as dist

    from sglang_dsv41_adapters.spectpsync import broadcast as b
    from sglang_dsv41_adapters.rank0_broadcast import before_0_5_19 as r
    from sglang_dsv41_adapters.engine.installed import engine_version
    from sglang_dsv41_adapters.folded_fence import accept_snapshot  # noqa: F401  (offers the kernel library, as a rank's registry does)
    from harness.nccl import device_of, make_group

    skewed = frozenset(skewed)
    originals = {(m, name): vars(importlib.import_module(f"{r.PACKAGE}.{m}"))[name] for m, name in BINDINGS}
    group, kind = make_group(rank, world, nccl)
    device = device_of(group, nccl)
    b.bind_group(b.DSPARK, group)
    # the imported package's own version; and the one the runtime judged (its metadata, else that file)
    out = {"group": kind, "sglang": sglang.__version__, "sglang_file": sglang.__file__,
           "engine_version": engine_version(), "variants": {}}
    histories, spans = {}, None
    try:
        for name, value in VARIANTS.items():
            state = _configure(value)
            histories[name], spans, result = _variant(rank, group, nccl, device, n, skewed, originals)
            out["variants"][name] = dict(result, state=state)
    finally:
        _configure(None)
        b.reset()
    reference = histories["off"].clone()
    dist.broadcast(reference, src=0)  # rank 0's values without the adapter, over the gloo default group
    for name, history in histories.items():
        out["variants"][name]["rows_off"] = {
            field: [i for i in range(n) if not torch.equal(history[i, a:z], reference[i, a:z])]
            for field, (a, z) in spans.items()}
        out["variants"][name]["distinct_rows"] = len({tuple(row.tolist()) for row in history})
    return out
