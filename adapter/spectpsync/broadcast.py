"""The rank-0 broadcast on the decode path (what rank0_broadcast's wrappers call).

Each family (DSpark, DFlash) broadcasts over the group its worker resolved once in
`__init__`, outside the draft context: the attention-TP group under DP attention,
else the TP group (upstream's rule).
"""

from __future__ import annotations

import collections

from .sites import Site

DSPARK, DFLASH = "dspark", "dflash"

# Sites the pack's broadcast does not serve before 0.5.19, and what does.
SERVED_ELSEWHERE = {Site.DSPARK_MEM: "DSV41_GROUP_MIN_MEM", Site.DFLASH_MEM: "DSV41_GROUP_MIN_MEM",
                    Site.DSPARK_PLAN: "the engine itself (dspark_planner broadcasts verify_lens)",
                    Site.DFLASH_SELECTOR: "nothing: there is no DFlash selector before 0.5.19"}

_groups: dict = {}
# Collectives issued per site (Site) since the last reset, counted in Python: a site
# inside a captured graph counts once per capture, then replays without Python.
COUNTS: collections.Counter = collections.Counter()


def reset() -> None:
    """Forget the recorded groups and the counts (tests)."""
    _groups.clear()
    COUNTS.clear()


def resolve_group():
    """Upstream's rule: the attention-TP group under DP attention, else the TP group."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    return parallel.attn_tp_group if parallel.enable_dp_attention else parallel.tp_group


def bind_group(family: str, group) -> None:
    """Record the group a family's sites broadcast over (a GroupCoordinator: .broadcast(t,
    src=0), .world_size)."""
    _groups[family] = group


def group_of(family: str):
    group = _groups.get(family)
    if group is None:
        raise RuntimeError(f"rank0_broadcast: no TP group recorded for {family} (its worker __init__ did not run "
                           f"through the adapter); refusing to decide per rank")
    return group


def _broadcast_one(group, tensor) -> None:
    if tensor.is_contiguous():
        group.broadcast(tensor, src=0)
    else:
        tmp = tensor.contiguous()
        group.broadcast(tmp, src=0)
        tensor.copy_(tmp)


def _packable(tensors) -> bool:
    device = tensors[0].device
    return all(t.is_contiguous() and t.device == device for t in tensors)


def _pack_and_broadcast(group, tensors) -> tuple:
    """One collective for several tensors: their bytes side by side in one buffer (one
    concatenation), broadcast, and each result a view of that buffer with the tensor's
    own dtype and shape, so nothing is copied back (the decision functions whose results
    are packed return fresh tensors their callers bind locally). The buffer's dtype is
    the narrowest field's, so fields of that dtype need no view; wider fields go first,
    which keeps every offset a multiple of the field's element size."""
    import torch

    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    fields = [tensors[i] for i in order]
    unit = fields[-1].dtype if fields[-1].dtype != torch.bool else torch.uint8  # NCCL has no bool
    width = fields[-1].element_size()
    packed = torch.cat([_flat(t).view(unit) if t.dtype != unit else _flat(t) for t in fields])
    group.broadcast(packed, src=0)
    out = [None] * len(tensors)
    chunks = packed.split_with_sizes([t.numel() * t.element_size() // width for t in fields])
    for i, t, chunk in zip(order, fields, chunks):
        row = chunk if t.dtype == unit else chunk.view(t.dtype)
        if t.dim() != 1:
            row = row.view(t.shape)
        # A view may alias engine state that is read elsewhere: it takes rank 0's values in place.
        out[i] = row if t._base is None else t.copy_(row)
    return tuple(out)


def _flat(tensor):
    return tensor if tensor.dim() == 1 else tensor.reshape(-1)


def broadcast(family: str, site, *tensors) -> tuple:
    """Rank 0's values of `tensors`, in their order. Several contiguous tensors on one
    device go in one collective, and the results are new tensors (views of the received
    buffer) that the caller hands on instead of its own; otherwise each tensor is
    overwritten in place and returned."""
    group = group_of(family)
    if group.world_size == 1:
        return tensors
    if len(tensors) > 1 and _packable(tensors):
        COUNTS[site] += 1
        return _pack_and_broadcast(group, tensors)
    for t in tensors:
        _broadcast_one(group, t)
        COUNTS[site] += 1
    return tensors
