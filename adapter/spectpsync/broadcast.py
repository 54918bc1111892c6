"""The rank-0 broadcast on the decode path (what rank0_broadcast's wrappers call).

Each family (DSpark, DFlash) broadcasts over the group its worker resolved once in
`__init__`, outside the draft context: the attention-TP group under DP attention,
else the TP group (upstream's rule).

Several tensors at one site (the accept triple) go in one collective of one block that
holds a copy of each. On CUDA the block is made by the pack's compiled kernel library
(library.py; its `pack`: one allocation, one copy launch, the typed results
made in C++), which costs about one launch of host time; on the CPU, without the kernel
file, or for fields it cannot take (not 4-byte elements, not contiguous), by one
concatenation of the fields' bytes and Python views, which costs several. Which one serves
CUDA tensors is said once per process.
"""

from __future__ import annotations

import collections

from . import library
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

_UNDECIDED = object()
_block_packer = _UNDECIDED  # the kernel library's `pack` for CUDA tensors, None where it does not serve
_use_kernel = True          # use_kernel() (tests, benchmarks)
_said_unpackable: set = set()  # sites whose fields the kernel could not take, said once each


def reset() -> None:
    """Forget the recorded groups, the counts and the packing decision (tests)."""
    global _block_packer
    _groups.clear()
    COUNTS.clear()
    _block_packer = _UNDECIDED
    _said_unpackable.clear()


def use_kernel(enabled: bool) -> None:
    """Pack CUDA tensors with the kernel library where it serves (the default), or by
    concatenation (tests and benchmarks compare both); decided again, and said, at the next call."""
    global _use_kernel, _block_packer
    _use_kernel, _block_packer = bool(enabled), _UNDECIDED


def packing_mode() -> tuple[str, str]:
    """("one-launch block", the kernel file) or ("concatenation", why) for CUDA tensors. The
    first call loads the kernel file (a dlopen, no compile: library.py)."""
    return library.serving(_use_kernel, "one-launch block", "concatenation")[:2]


def _decide_packer():
    global _block_packer
    from ..framework import log

    mode, detail, kernel = library.serving(_use_kernel, "one-launch block", "concatenation")
    _block_packer = kernel.pack if kernel is not None else None
    # Probed at the first CUDA call, on the rank's own device; one line says which serves.
    log.emit(f"rank0_broadcast packing: {mode} - {detail}", adapter="rank0_broadcast", packing=mode, detail=detail)
    return _block_packer


def resolve_group(server_args):
    """Upstream's rule: the attention-TP group under DP attention, else the TP group. DP
    attention is read from the server arguments a worker is built with, as the engine's own
    workers read it (its runtime context serves `enable_dp_attention` only from 0.5.18, and
    only once the server has published its configuration)."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    return parallel.attn_tp_group if server_args.enable_dp_attention else parallel.tp_group


def worker_server_args(args, kwargs):
    """The server arguments of a worker's __init__(self, server_args, ...) call (declared
    POSITIONAL by the hooks that read it)."""
    return args[0] if args else kwargs["server_args"]


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


def keeps_inputs(tensors) -> bool:
    """Whether broadcast() leaves `tensors` as they were: several packed into one
    collective, each result a copy in the block (neither path writes back into a tensor
    that is not a view; a view's result goes back into it)."""
    if len(tensors) < 2:
        return False
    device = tensors[0].device
    for t in tensors:  # one plain loop: it runs before every packed site call with the report on
        if t._base is not None or not t.is_contiguous() or t.device != device:
            return False
    return True


def _block_broadcast(group, site, tensors):
    """One collective of one block made by the kernel library (one launch copies the
    fields into it); the results are its typed tensors. None where the kernel cannot take
    the fields."""
    packer = _block_packer if _block_packer is not _UNDECIDED else _decide_packer()
    if packer is None:
        return None
    parts = packer(tensors)
    if not parts:
        if site not in _said_unpackable:
            from ..framework import log

            _said_unpackable.add(site)
            fields = ", ".join(f"{t.dtype}{'' if t.is_contiguous() else ' (not contiguous)'}" for t in tensors)
            log.emit(f"rank0_broadcast packing: site {int(site)} by concatenation - the kernel takes contiguous "
                     f"4-byte-multiple fields on one GPU, not {fields}", adapter="rank0_broadcast", site=int(site))
        return None
    group.broadcast(parts[0], src=0)
    # A view may alias engine state that is read elsewhere: it takes rank 0's values in place.
    return tuple([v if t._base is None else t.copy_(v) for t, v in zip(tensors, parts[1:])])


def _pack_and_broadcast(group, tensors) -> tuple:
    """One collective for several tensors: their bytes side by side in one buffer (one
    concatenation), broadcast, and each result a view of that buffer with the tensor's
    own dtype and shape, so nothing is copied back (the decision functions whose results
    are packed return fresh tensors their callers bind locally). The buffer's dtype is
    the narrowest field's, so fields of that dtype need no view; wider fields go first,
    which keeps every offset a multiple of the field's element size. The path for CPU
    tensors and where the kernel library does not serve (_block_broadcast)."""
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
    device go in one collective, and the results are new tensors (over the received
    block) that the caller hands on instead of its own, which stay as they were
    (keeps_inputs); otherwise each tensor is overwritten in place and returned."""
    group = group_of(family)
    if group.world_size == 1:
        return tensors
    if len(tensors) > 1:
        if tensors[0].is_cuda:
            out = _block_broadcast(group, site, tensors)
            if out is not None:
                COUNTS[site] += 1
                return out
        if _packable(tensors):
            COUNTS[site] += 1
            return _pack_and_broadcast(group, tensors)
    for t in tensors:
        _broadcast_one(group, t)
        COUNTS[site] += 1
    return tensors
