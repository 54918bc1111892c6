"""The rank-0 broadcast on the decode path (what rank0_broadcast's wrappers call).

Each family (DSpark, DFlash) broadcasts over the group its worker resolved once in
`__init__`, outside the draft context: the attention-TP group under DP attention,
else the TP group (upstream's rule).
"""

from __future__ import annotations

import collections

DSPARK, DFLASH = "dspark", "dflash"

_groups: dict = {}
# Collectives issued per site slug since the last reset (counted in Python: a site
# inside a captured graph counts once per capture, then replays without Python).
COUNTS: collections.Counter = collections.Counter()
_INTS = None


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


def _int_dtypes():
    global _INTS
    if _INTS is None:
        import torch

        _INTS = {torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64}
    return _INTS


def _broadcast_one(group, tensor) -> None:
    if tensor.is_contiguous():
        group.broadcast(tensor, src=0)
    else:
        tmp = tensor.contiguous()
        group.broadcast(tmp, src=0)
        tensor.copy_(tmp)


def broadcast(family: str, site, *tensors) -> None:
    """Overwrite each tensor in place with rank 0's value: one collective when the
    tensors are integer vectors of one shape and device (packed as int64 [n, bs]),
    else one per tensor."""
    group = group_of(family)
    if group.world_size == 1:
        return
    import torch

    first = tensors[0]
    packable = len(tensors) > 1 and all(
        t.dtype in _int_dtypes() and t.dim() == 1 and t.shape == first.shape and t.device == first.device
        for t in tensors)
    if packable:
        packed = torch.stack([t.to(torch.int64) for t in tensors])
        group.broadcast(packed, src=0)
        for t, row in zip(tensors, packed):
            t.copy_(row)
        COUNTS[site.slug] += 1
        return
    for t in tensors:
        _broadcast_one(group, t)
        COUNTS[site.slug] += 1
